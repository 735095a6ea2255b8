// GGML's block formats, as GGUF files store them, decoded to float32 one row at a time.
//
// A GGUF weight [N, K] is N rows, each K / block_elements blocks of block_bytes bytes
// laid end to end. The formats (ggml-common.h; all little-endian, `half` = float16):
//
//   type    elems bytes  block layout                                    value
//   Q4_0     32    18    half d | u8 qs[16]                              d (q - 8)
//   Q4_1     32    20    half d, m | u8 qs[16]                           d q + m
//   Q5_0     32    22    half d | u32 qh | u8 qs[16]                     d (q - 16)
//   Q5_1     32    24    half d, m | u32 qh | u8 qs[16]                  d q + m
//   Q8_0     32    34    half d | i8 qs[32]                              d q
//   IQ4_NL   32    18    half d | u8 qs[16]                              d kvalues[q]
//   Q2_K    256    84    u8 scales[16] | u8 qs[64] | half d, dmin        d sc q - dmin m    (16 per sub-block)
//   Q3_K    256   110    u8 hmask[32] | u8 qs[64] | u8 scales[12] | half d   d (sc - 32) q  (q in -4..3)
//   Q4_K    256   144    half d, dmin | u8 scales[12] | u8 qs[128]       d sc q - dmin m    (32 per sub-block)
//   Q5_K    256   176    half d, dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
//   Q6_K    256   210    u8 ql[128] | u8 qh[64] | i8 scales[16] | half d  d sc (q - 32)    (16 per sub-block)
//   IQ4_XS  256   136    half d | u16 scales_h | u8 scales_l[4] | u8 qs[128]  d (sc - 32) kvalues[q]
//
// Where the q bits of element e sit (the part that is easy to get wrong):
//   32-blocks:  the low nibble of qs[j] is element j, the high nibble element j + 16;
//               Q5's fifth bit of element j is bit j of qh.
//   Q4_K/Q5_K:  64 elements per 32 bytes of qs: element 64c + l (l < 32) is the low nibble
//               of qs[32c + l], element 64c + 32 + l its high nibble; Q5_K's fifth bit of
//               element e is bit e / 32 of qh[e % 32]. Sub-block j = e / 32 has 6-bit scale
//               and min packed in 12 bytes (unpack_k4_scales).
//   Q6_K:       per half h of 128: element t*32 + l takes the low (t = 0, 1) or high
//               (t = 2, 3) nibble of ql[64h + 32(t % 2) + l] and bits 2t, 2t+1 of qh[32h + l].
//   Q2_K/Q3_K:  per half h of 128: element t*32 + l is bits 2t, 2t+1 of qs[32h + l]; Q3_K's
//               high bit of element e is bit e / 32 of hmask[e % 32] (set: q, clear: q - 4).
//
// The reference these decoders are tested against is gguf-py's `dequantize`.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace gguf {

// GGML type ids (ggml.h), as the GGUF tensor index stores them.
enum Type : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30,
};

struct BlockFormat {
  int64_t elements = 0;  // weights per block (0: a type these decoders do not know)
  int64_t bytes = 0;
};

constexpr BlockFormat block_format(int64_t type) {
  switch (type) {
    case F32: return {1, 4};
    case F16: return {1, 2};
    case BF16: return {1, 2};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case IQ4_NL: return {32, 18};
    case Q2_K: return {256, 84};
    case Q3_K: return {256, 110};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    case IQ4_XS: return {256, 136};
    default: return {};
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

// Q4_K / Q5_K: 8 six-bit scales and mins from 12 bytes b[0..11]:
//   sc[j] = b[j] & 63,  m[j] = b[j + 4] & 63                                      j < 4
//   sc[j] = (b[j + 4] & 15) | (b[j - 4] >> 6) << 4,  m[j] = (b[j + 4] >> 4) | (b[j] >> 6) << 4   j >= 4
// done four at a time on 32-bit words (w0 = b[0..3], w1 = b[4..7], w2 = b[8..11]).
inline void unpack_k4_scales(const uint8_t* packed, uint8_t sc[8], uint8_t mn[8]) {
  uint32_t w[3];
  std::memcpy(w, packed, 12);
  const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, two = 0x03030303u;
  const uint32_t s[2] = {w[0] & low6, (w[2] & low4) | (((w[0] >> 6) & two) << 4)};
  const uint32_t m[2] = {w[1] & low6, ((w[2] >> 4) & low4) | (((w[1] >> 6) & two) << 4)};
  std::memcpy(sc, s, 8);
  std::memcpy(mn, m, 8);
}

// Q3_K: 16 six-bit scales (minus 32) from 12 bytes: low nibbles from b[0..7]
// (scale i: b[i % 8] >> 4 (i / 8)), high two bits from b[8..11] (b[8 + i % 4] >> 2 (i / 4)).
inline void unpack_q3_scales(const uint8_t* b, int8_t sc[16]) {
  for (int i = 0; i < 16; ++i) {
    const int low = (b[i % 8] >> (4 * (i / 8))) & 0x0F;
    const int high = (b[8 + i % 4] >> (2 * (i / 4))) & 0x03;
    sc[i] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
}

// One block at `b` -> its `elements` floats at `y`.
inline void dequantize_block(int64_t type, const uint8_t* b, float* y) {
  switch (type) {
    case F32: std::memcpy(y, b, 4); return;
    case F16: *y = half_at(b); return;
    case BF16: {
      uint16_t bits;
      std::memcpy(&bits, b, 2);
      *y = static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
      return;
    }
    case Q4_0: case Q4_1: case IQ4_NL: {
      const float d = half_at(b);
      const float m = type == Q4_1 ? half_at(b + 2) : 0.f;
      const uint8_t* qs = b + (type == Q4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        const int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
        if (type == IQ4_NL) {
          y[j] = d * kIQ4Values[lo];
          y[j + 16] = d * kIQ4Values[hi];
        } else if (type == Q4_0) {
          y[j] = d * (lo - 8);
          y[j + 16] = d * (hi - 8);
        } else {
          y[j] = d * lo + m;
          y[j + 16] = d * hi + m;
        }
      }
      return;
    }
    case Q5_0: case Q5_1: {
      const bool has_min = type == Q5_1;
      const float d = half_at(b), m = has_min ? half_at(b + 2) : 0.f;
      uint32_t qh;
      std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
      const uint8_t* qs = b + (has_min ? 8 : 6);
      for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = has_min ? d * lo + m : d * (lo - 16);
        y[j + 16] = has_min ? d * hi + m : d * (hi - 16);
      }
      return;
    }
    case Q8_0: {
      const float d = half_at(b);
      const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
      for (int j = 0; j < 32; ++j) y[j] = d * qs[j];
      return;
    }
    case Q2_K: {
      const uint8_t* scales = b;
      const uint8_t* qs = b + 16;
      const float d = half_at(b + 80), dmin = half_at(b + 82);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, t = (e % 128) / 32, l = e % 32;
        const int q = (qs[32 * h + l] >> (2 * t)) & 3;
        const uint8_t sc = scales[e / 16];
        y[e] = d * (sc & 0x0F) * q - dmin * (sc >> 4);
      }
      return;
    }
    case Q3_K: {
      const uint8_t* hmask = b;
      const uint8_t* qs = b + 32;
      int8_t sc[16];
      unpack_q3_scales(b + 96, sc);
      const float d = half_at(b + 108);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, t = (e % 128) / 32, l = e % 32;
        const int low = (qs[32 * h + l] >> (2 * t)) & 3;
        const int q = low - (((hmask[e % 32] >> (e / 32)) & 1) ? 0 : 4);
        y[e] = d * sc[e / 16] * q;
      }
      return;
    }
    case Q4_K: case Q5_K: {
      const float d = half_at(b), dmin = half_at(b + 2);
      uint8_t sc[8], mn[8];
      unpack_k4_scales(b + 4, sc, mn);
      const bool five = type == Q5_K;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int e = 0; e < 256; ++e) {
        const int c = e / 64, l = e % 32;
        const uint8_t byte = qs[32 * c + l];
        int q = (e % 64) < 32 ? (byte & 0x0F) : (byte >> 4);
        if (five) q |= ((qh[l] >> (e / 32)) & 1) << 4;
        y[e] = d * sc[e / 32] * q - dmin * mn[e / 32];
      }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, t = (e % 128) / 32, l = e % 32;
        const uint8_t low = ql[64 * h + 32 * (t % 2) + l];
        const int q = ((t < 2 ? low & 0x0F : low >> 4) | (((qh[32 * h + l] >> (2 * t)) & 3) << 4)) - 32;
        y[e] = d * sc[e / 16] * q;
      }
      return;
    }
    case IQ4_XS: {
      const float d = half_at(b);
      uint16_t scales_h;
      std::memcpy(&scales_h, b + 2, 2);
      const uint8_t* scales_l = b + 4;
      const uint8_t* qs = b + 8;
      for (int j = 0; j < 8; ++j) {
        const int ls = (scales_l[j / 2] >> (4 * (j % 2))) & 0x0F;
        const int hs = (scales_h >> (2 * j)) & 0x03;
        const float dl = d * ((ls | (hs << 4)) - 32);
        for (int l = 0; l < 16; ++l) {
          y[32 * j + l] = dl * kIQ4Values[qs[16 * j + l] & 0x0F];
          y[32 * j + 16 + l] = dl * kIQ4Values[qs[16 * j + l] >> 4];
        }
      }
      return;
    }
    default: return;
  }
}

template <int64_t kType>
inline void dequantize_row_of(const uint8_t* row, float* y, int64_t k) {
  constexpr BlockFormat f = block_format(kType);
  for (int64_t i = 0; i < k / f.elements; ++i)
    dequantize_block(kType, row + i * f.bytes, y + i * f.elements);
}

// One row of `k` weights (k a multiple of the type's block) -> k floats. The switch
// picks a loop per type, in which the block decoder's own switch folds away.
inline void dequantize_row(int64_t type, const uint8_t* row, float* y, int64_t k) {
  switch (type) {
    case F32: std::memcpy(y, row, k * 4); return;
    case F16: for (int64_t i = 0; i < k; ++i) y[i] = half_at(row + 2 * i); return;
    case BF16: return dequantize_row_of<BF16>(row, y, k);
    case Q4_0: return dequantize_row_of<Q4_0>(row, y, k);
    case Q4_1: return dequantize_row_of<Q4_1>(row, y, k);
    case Q5_0: return dequantize_row_of<Q5_0>(row, y, k);
    case Q5_1: return dequantize_row_of<Q5_1>(row, y, k);
    case Q8_0: return dequantize_row_of<Q8_0>(row, y, k);
    case IQ4_NL: return dequantize_row_of<IQ4_NL>(row, y, k);
    case Q2_K: return dequantize_row_of<Q2_K>(row, y, k);
    case Q3_K: return dequantize_row_of<Q3_K>(row, y, k);
    case Q4_K: return dequantize_row_of<Q4_K>(row, y, k);
    case Q5_K: return dequantize_row_of<Q5_K>(row, y, k);
    case Q6_K: return dequantize_row_of<Q6_K>(row, y, k);
    case IQ4_XS: return dequantize_row_of<IQ4_XS>(row, y, k);
    default: return;
  }
}

}  // namespace gguf
