// int4 and int8 weights in blocks of 16 output rows: the decode-step kernels for wide
// batches (several rows of x: many clients, or a speculative step's 1 + k rows).
//
// quant_linear.cpp's layouts keep each output row's groups together, so a row of x
// against one group is one integer dot over 32 weights, and turning that dot's vector of
// partial sums into a float costs a convert and an FMA per (row of x, output row, group):
// with 8 rows of x that post-processing, not the multiply-adds, bounded the kernel (8 rows
// cost several times one row: docs/performance.md). Here the vector lanes are 16 output rows
// instead: one multiply-add takes two weights of each of 16 output rows against one
// broadcast pair of x's values, so after a group's 16 multiply-adds each lane holds its
// output row's whole group dot and one convert + FMA scales 16 of them.
//
// Both layouts hand the multiply-adds, per block b (output rows 16 b .. 16 b + 15),
// group g (32 input columns) and quad t (columns 4 t .. 4 t + 3 of the group), two
// vectors of 16 lanes x 2 int16: lane j = (q[16 b + j, 4t], q[.., 4t + 1]) and
// (q[.., 4t + 2], q[.., 4t + 3]), what vpdpwssd / madd multiply with the broadcast int32
// (xq[4t], xq[4t + 1]) and (xq[4t + 2], xq[4t + 3]). (Columns relative to group g.)
//
// int4, uint8 [N / 16, K / 32, 256]: 32 bytes per quad at ((b G + g) 8 + t) 32, where
//   byte 2 j     = q[16 b + j, 32 g + 4 t]     | q[16 b + j, 32 g + 4 t + 2] << 4
//   byte 2 j + 1 = q[16 b + j, 32 g + 4 t + 1] | q[16 b + j, 32 g + 4 t + 3] << 4
// so the low nibbles widened to int16 are the first pair and the high nibbles the second.
// Example, block 0, group 0, quad 0 with q[j, 0..3] = (1, 2, 3, 4) for every j:
// byte 2j = 0x31, 2j + 1 = 0x42.
// int8, int8 [N / 16, K / 32, 512]: 64 bytes per quad at ((b G + g) 8 + t) 64, where
//   byte 2 j      = q[16 b + j, 32 g + 4 t],     byte 2 j + 1      = q[.., 32 g + 4 t + 1]
//   byte 32 + 2 j = q[16 b + j, 32 g + 4 t + 2], byte 32 + 2 j + 1 = q[.., 32 g + 4 t + 3]
// so each 32 bytes sign-extended to int16 (vpmovsxbw) is one of the two vectors. That is,
// per group the bytes are [pair p = 0..15][lane j][2]: the group's column pairs one
// after another, 16 rows each. Example, q[j, 0..3] = (1, -2, 3, 4) for every j: bytes
// 0 .. 31 of block 0, group 0 are 0x01 0xFE 0x01 0xFE ..., bytes 32 .. 63 0x03 0x04 ...
// Scales (and int4's mins) are float16 [N / 16, G, 16] (lane j of group g = row 16 b + j),
// or K-quant super-blocks of 8 groups (GroupLanes below: Q4_K repacked exactly).
// engine.models.quant.block_int4 / block_int8 build these layouts from quant_linear.cpp's.
//
// Arithmetic (the same as quant_linear.cpp, so the same reference): x is rounded per row
// and group of 32 to int16 with scale dx, and
//   out[m, n] = sum_g scales[n, g] dx[m, g] (q[n, g] . xq[m, g]) + mins[n, g] dx[m, g] sum(xq[m, g])
// (int8: no mins term). Each (m, n) takes the same instructions in the same order
// whatever the batch: the kernel is batch invariant. Reference:
// pagedserve_kernels.reference.quant_linear_ref.
//
// 8-bit activations (activation_bits() == 8, group32_activations.h): x rounded to int8
// per group (dx = max |x| / 127), the same formula. A quad's four columns of one output row
// become one 32-bit lane of four bytes, so one u8 x s8 instruction (vpdpbusd with VNNI,
// else maddubs + madd) takes all four products of each of 16 (zmm) or 8 (ymm) rows, where
// the int16 path needs two vpdpwssd and two widenings of the weights:
//   int4: lane j = (q[j, 4t], q[j, 4t + 1], q[j, 4t + 2], q[j, 4t + 3]) unsigned (0..15)
//         against x's four int8 values broadcast: the weights are the unsigned side, and
//         the min term (mins * dx * sum(xq)) is unchanged;
//   int8: the same lanes of signed weights against x + 128 (unsigned, 1..255, the bytes of
//         xq xor 0x80): sum (xq + 128) q = sum xq q + 128 sum q, and sum q (per lane and
//         group, one vpdpbusd of the weights against bytes of 1) is subtracted, exactly.
// Bounds are above each kernel. int8 weights without VNNI (maddubs would saturate: 2 * 255 *
// 127 > 32767) and the portable build take the int16 code with the int8-valued xq: the same
// integers, the same results.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "group32_activations.h"
#include "madd512.h"
#include "spin_pool.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <c10/util/Half.h>

namespace {

using namespace pagedserve::group32;  // kGroup, half_to_float, halves, quantize_activations

constexpr int64_t kLanes = 16;

// Bytes of one block's group: 16 rows x 32 weights in 4 (int4) or 8 (int8) bits.
template <bool kInt8>
constexpr int64_t kBytesPerGroup = kInt8 ? 512 : 256;

// Where one block's per-group scales (or int4's mins) come from; lane j = output row
// 16 b + j. Two forms:
//   float16 [G, 16] (quant.py's int4/int8, the repacked 32-block GGUF types);
//   super-blocks of 8 groups, uint8 [G / 8, 160] (GGUF Q4_K repacked exactly:
//   engine.models.gguf_weight.repack): per super-block s, float16 d[16] in bytes 0..31,
//   then uint8 k[8][16]; group 8 s + i's value in lane j is d[j] * k[i][j], exact in
//   float32 (an 11-bit significand times a 6-bit integer). Q4_K's mins hold -dmin and m.
//   Example: d[3] = 0.5, k[2][3] = 7: lane 3 of group 8 s + 2 is 3.5.
// Every path (scalar, 8 or 16 lanes) forms the same float32 values.
struct GroupLanes {
  static constexpr int64_t kSuperBytes = 160;
  const uint8_t* p = nullptr;
  bool super_blocks = false;

  // Block b's lanes, for a weight of `groups` groups per row.
  GroupLanes block(int64_t b, int64_t groups) const {
    const int64_t bytes = super_blocks ? groups / 8 * kSuperBytes : groups * kLanes * 2;
    return {p + b * bytes, super_blocks};
  }
  float lane(int64_t g, int j) const {
    if (!super_blocks) return half_to_float(reinterpret_cast<const uint16_t*>(p)[g * kLanes + j]);
    const uint8_t* s = p + (g / 8) * kSuperBytes;
    return half_to_float(reinterpret_cast<const uint16_t*>(s)[j]) *
           static_cast<float>(s[32 + 16 * (g % 8) + j]);
  }
#if defined(__AVX512F__) && defined(__F16C__)
  __m512 lanes16(int64_t g) const {
    if (!super_blocks)
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * g)));
    const uint8_t* s = p + (g / 8) * kSuperBytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    const __m128i k = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32 + 16 * (g % 8)));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k)));
  }
#endif
#if defined(__AVX2__) && defined(__F16C__)
  // Lanes 8 h .. 8 h + 7.
  __m256 lanes8(int64_t g, int h) const {
    if (!super_blocks)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * g + 16 * h)));
    const uint8_t* s = p + (g / 8) * kSuperBytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 * h)));
    const __m128i k = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 32 + 16 * (g % 8) + 8 * h));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(k)));
  }
#endif
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
inline __m512i pair_dot(__m512i acc, __m512i w, int32_t x_pair) {
  return madd_accumulate(acc, w, _mm512_set1_epi32(x_pair));
}

// Quad t of a group's bytes as its two vectors of 16 lanes x 2 int16 (see the header).
template <bool kInt8>
inline void quad_weights(const uint8_t* bytes, int t, __m512i& w01, __m512i& w23) {
  if (kInt8) {
    const __m256i* p = reinterpret_cast<const __m256i*>(bytes + 64 * t);
    w01 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(p));
    w23 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(p + 1));
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * t));
    w01 = _mm512_cvtepu8_epi16(_mm256_and_si256(v, low4));
    w23 = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
  }
}

// out[m0 .. m0 + R - 1, 16 b .. 16 b + 15] from one block's bytes (mins: int4 only).
template <bool kInt8, int R>
void block_rows(const uint8_t* block, GroupLanes scales, GroupLanes mins,
                int64_t groups, const QuantizedActivations& a, int64_t cols, int64_t m0, float* out,
                int64_t out_stride) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    const uint8_t* bytes = block + g * kBytesPerGroup<kInt8>;
    for (int t = 0; t < 8; ++t) {
      __m512i w01, w23;
      quad_weights<kInt8>(bytes, t, w01, w23);
      for (int r = 0; r < R; ++r) {
        const int32_t* pairs =
            reinterpret_cast<const int32_t*>(a.values.data() + (m0 + r) * cols + g * kGroup + 4 * t);
        dot[r] = pair_dot(pair_dot(dot[r], w01, pairs[0]), w23, pairs[1]);
      }
    }
    const __m512 scale = scales.lanes16(g);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * groups + g;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                               _mm512_mul_ps(scale, _mm512_set1_ps(a.scales[at])), acc[r]);
    }
    if (!kInt8) {
      const __m512 lowest = mins.lanes16(g);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(lowest, _mm512_set1_ps(a.sums[(m0 + r) * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (m0 + r) * out_stride, acc[r]);
}
#elif defined(__AVX2__) && defined(__F16C__)
// Quad t's two vectors per half h of the block (lanes 0-7, 8-15): w[h][0], w[h][1].
template <bool kInt8>
inline void quad_weights(const uint8_t* bytes, int t, __m256i w[2][2]) {
  if (kInt8) {
    for (int i = 0; i < 2; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 64 * t + 32 * i));
      w[0][i] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
      w[1][i] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
    }
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * t));
    const __m256i lo = _mm256_and_si256(v, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    w[0][0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));
    w[0][1] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));
    w[1][0] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
    w[1][1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
  }
}

// The same on 256-bit vectors: lanes 0-7 and 8-15 of the block in two registers.
template <bool kInt8, int R>
void block_rows(const uint8_t* block, GroupLanes scales, GroupLanes mins,
                int64_t groups, const QuantizedActivations& a, int64_t cols, int64_t m0, float* out,
                int64_t out_stride) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    const uint8_t* bytes = block + g * kBytesPerGroup<kInt8>;
    for (int t = 0; t < 8; ++t) {
      __m256i w[2][2];
      quad_weights<kInt8>(bytes, t, w);
      for (int r = 0; r < R; ++r) {
        const int32_t* pairs =
            reinterpret_cast<const int32_t*>(a.values.data() + (m0 + r) * cols + g * kGroup + 4 * t);
        const __m256i x01 = _mm256_set1_epi32(pairs[0]), x23 = _mm256_set1_epi32(pairs[1]);
        for (int h = 0; h < 2; ++h)
          dot[r][h] = _mm256_add_epi32(
              dot[r][h], _mm256_add_epi32(_mm256_madd_epi16(w[h][0], x01),
                                          _mm256_madd_epi16(w[h][1], x23)));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = scales.lanes8(g, h);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * groups + g;
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]),
                                    _mm256_mul_ps(scale, _mm256_set1_ps(a.scales[at])), acc[r][h]);
      }
      if (!kInt8) {
        const __m256 lowest = mins.lanes8(g, h);
        for (int r = 0; r < R; ++r)
          acc[r][h] = _mm256_fmadd_ps(lowest, _mm256_set1_ps(a.sums[(m0 + r) * groups + g]),
                                      acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + (m0 + r) * out_stride + 8 * h, acc[r][h]);
}
#else
// Lane j's four weights of quad t (columns 4t .. 4t + 3 of the group).
template <bool kInt8>
inline void quad_lane(const uint8_t* bytes, int t, int j, int32_t q[4]) {
  if (kInt8) {
    const int8_t* b = reinterpret_cast<const int8_t*>(bytes + 64 * t + 2 * j);
    q[0] = b[0], q[1] = b[1], q[2] = b[32], q[3] = b[33];
  } else {
    const uint8_t* b = bytes + 32 * t + 2 * j;
    q[0] = b[0] & 15, q[1] = b[1] & 15, q[2] = b[0] >> 4, q[3] = b[1] >> 4;
  }
}

template <bool kInt8, int R>
void block_rows(const uint8_t* block, GroupLanes scales, GroupLanes mins,
                int64_t groups, const QuantizedActivations& a, int64_t cols, int64_t m0, float* out,
                int64_t out_stride) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kLanes; ++j) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int t = 0; t < 8; ++t) {
          int32_t q[4];
          quad_lane<kInt8>(block + g * kBytesPerGroup<kInt8>, t, j, q);
          const int16_t* x = a.values.data() + (m0 + r) * cols + g * kGroup + 4 * t;
          dot += q[0] * x[0] + q[1] * x[1] + q[2] * x[2] + q[3] * x[3];
        }
        const int64_t at = (m0 + r) * groups + g;
        acc = std::fma(static_cast<float>(dot), scales.lane(g, j) * a.scales[at], acc);
        if (!kInt8) acc = std::fma(mins.lane(g, j), a.sums[at], acc);
      }
      out[(m0 + r) * out_stride + j] = acc;
    }
}
#endif

// ---- 8-bit activations (see the header) ----
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#define PAGEDSERVE_X8_INT4 1
#if defined(__AVX512VNNI__)
#define PAGEDSERVE_X8_INT8 1
#endif

// Quad t of an int4 group as 16 lanes x 4 uint8 (q[j, 4t], .., q[j, 4t + 3]). Word j of
// the quad's 32 bytes holds q[4t] | q[4t + 2] << 4 | q[4t + 1] << 8 | q[4t + 3] << 12;
// zero-extended to 32 bits (v), (v | v << 12) & 0x0F0F0F0F has q[4t] in byte 0, q[4t + 1]
// in byte 1 (both from v), q[4t + 2] in byte 2 and q[4t + 3] in byte 3 (from v << 12).
// Example, bytes 0x31 0x42 (q = 1, 2, 3, 4): v = 0x4231, v | v << 12 = 0x04235231,
// masked 0x04030201: bytes 1, 2, 3, 4.
inline __m512i int4_quad_u8(const uint8_t* bytes, int t) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * t)));
  return _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), _mm512_set1_epi32(0x0F0F0F0F));
}

#if defined(__AVX512VNNI__)
// acc + the four u8 x s8 products of each 32-bit lane (vpdpbusd). Written as an asm
// statement that accumulates in place: with the intrinsic, GCC 12 copies each of 8 rows'
// accumulators to another register and back around every vpdpbusd (16 extra moves per quad).
inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, u, s);
#endif
}
#endif

#if defined(PAGEDSERVE_X8_INT8)
// Quad t of an int8 group as 16 lanes x 4 int8: word j of the first 32 bytes is (q[j, 4t],
// q[j, 4t + 1]), word j of the next 32 (q[j, 4t + 2], q[j, 4t + 3]); one vpermw puts the
// two words of lane j side by side.
inline __m512i int8_quad_s8(const uint8_t* bytes, int t, __m512i words_to_lanes) {
  return _mm512_permutexvar_epi16(words_to_lanes, _mm512_loadu_si512(bytes + 64 * t));
}
#endif

// block_rows with int8 activations, 16 lanes per zmm.
// Bounds per lane and group (32 products): int4 with VNNI |sum| <= 32 * 15 * 127 = 60,960;
// int4 without VNNI, maddubs gives int16 pairs of at most 2 * 15 * 127 = 3,810 (no
// saturation), the 8 quads' pairs summed in int16 at most 8 * 3,810 = 30,480 < 32,767, one
// madd by 1 makes them int32; int8 (VNNI only) |sum (xq + 128) q| <= 32 * 255 * 128 =
// 1,044,480 and |128 sum q| <= 524,288: all far inside int32.
template <bool kInt8, int R>
void block_rows_x8(const uint8_t* block, GroupLanes scales, GroupLanes mins,
                   int64_t groups, const Int8Activations& a, int64_t cols, int64_t m0, float* out,
                   int64_t out_stride) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
#if defined(PAGEDSERVE_X8_INT8)
  alignas(64) int16_t interleave[32];
  for (int j = 0; j < 16; ++j) interleave[2 * j] = j, interleave[2 * j + 1] = 16 + j;
  const __m512i words_to_lanes = _mm512_load_si512(interleave);
  const __m512i ones_u8 = _mm512_set1_epi8(1);
#endif
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* bytes = block + g * kBytesPerGroup<kInt8>;
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    // x's four bytes of quad t, row r: one int32, broadcast.
    auto x4 = [&](int r, int t) {
      return _mm512_set1_epi32(
          reinterpret_cast<const int32_t*>(a.values.data() + (m0 + r) * cols + g * kGroup)[t]);
    };
#if defined(PAGEDSERVE_X8_INT8)
    if (kInt8) {
      __m512i wsum = _mm512_setzero_si512();
      for (int t = 0; t < 8; ++t) {
        const __m512i w = int8_quad_s8(bytes, t, words_to_lanes);
        wsum = dpbusd(wsum, ones_u8, w);
        for (int r = 0; r < R; ++r) dot[r] = dpbusd(dot[r], x4(r, t), w);
      }
      const __m512i offset = _mm512_slli_epi32(wsum, 7);  // 128 sum q
      for (int r = 0; r < R; ++r) dot[r] = _mm512_sub_epi32(dot[r], offset);
    } else {
      for (int t = 0; t < 8; ++t) {
        const __m512i w = int4_quad_u8(bytes, t);
        for (int r = 0; r < R; ++r) dot[r] = dpbusd(dot[r], w, x4(r, t));
      }
    }
#else
    static_assert(!kInt8, "int8 weights take the int16 code without VNNI");
    __m512i pairs[R];
    for (int r = 0; r < R; ++r) pairs[r] = _mm512_setzero_si512();
    for (int t = 0; t < 8; ++t) {
      const __m512i w = int4_quad_u8(bytes, t);
      for (int r = 0; r < R; ++r)
        pairs[r] = _mm512_add_epi16(pairs[r], _mm512_maddubs_epi16(w, x4(r, t)));
    }
    for (int r = 0; r < R; ++r) dot[r] = _mm512_madd_epi16(pairs[r], _mm512_set1_epi16(1));
#endif
    const __m512 scale = scales.lanes16(g);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * groups + g;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                               _mm512_mul_ps(scale, _mm512_set1_ps(a.scales[at])), acc[r]);
    }
    if (!kInt8) {
      const __m512 lowest = mins.lanes16(g);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(lowest, _mm512_set1_ps(a.sums[(m0 + r) * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (m0 + r) * out_stride, acc[r]);
}
#elif defined(__AVX2__) && defined(__F16C__)
#define PAGEDSERVE_X8_INT4 1
#if defined(__AVXVNNI__)
#define PAGEDSERVE_X8_INT8 1
#endif

// int4_quad_u8 on 256-bit vectors: w[h] = lanes 8h .. 8h + 7 (the quad's bytes 16h ..).
inline void int4_quad_u8(const uint8_t* bytes, int t, __m256i w[2]) {
  const __m256i low4 = _mm256_set1_epi32(0x0F0F0F0F);
  for (int h = 0; h < 2; ++h) {
    const __m256i v = _mm256_cvtepu16_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 32 * t + 16 * h)));
    w[h] = _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 12)), low4);
  }
}

#if defined(PAGEDSERVE_X8_INT8)
// int8_quad_s8 on 256-bit vectors. unpacklo/hi_epi16 of the two 32-byte halves work per
// 128-bit half, so w[0] holds lanes 0-3 | 8-11 and w[1] lanes 4-7 | 12-15: the kernel keeps
// that order and puts the lanes back once per block (permute2f128).
inline void int8_quad_s8(const uint8_t* bytes, int t, __m256i w[2]) {
  const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 64 * t));
  const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 64 * t + 32));
  w[0] = _mm256_unpacklo_epi16(first, second);
  w[1] = _mm256_unpackhi_epi16(first, second);
}
#endif

// block_rows with int8 activations, 8 lanes per ymm, AVX-VNNI (vpdpbusd on ymm) or AVX2
// maddubs + madd. Bounds as the zmm kernel's: int4 32 * 15 * 127 = 60,960 per lane and
// group; maddubs pairs <= 3,810 and 8 quads of them <= 30,480 in int16; int8 (AVX-VNNI only)
// |sum (xq + 128) q| <= 1,044,480.
template <bool kInt8, int R>
void block_rows_x8(const uint8_t* block, GroupLanes scales, GroupLanes mins,
                   int64_t groups, const Int8Activations& a, int64_t cols, int64_t m0, float* out,
                   int64_t out_stride) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* bytes = block + g * kBytesPerGroup<kInt8>;
    __m256i dot[R][2];
    auto x4 = [&](int r, int t) {
      return _mm256_set1_epi32(
          reinterpret_cast<const int32_t*>(a.values.data() + (m0 + r) * cols + g * kGroup)[t]);
    };
#if defined(PAGEDSERVE_X8_INT8)
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    if (kInt8) {
      const __m256i ones_u8 = _mm256_set1_epi8(1);
      __m256i wsum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int t = 0; t < 8; ++t) {
        __m256i w[2];
        int8_quad_s8(bytes, t, w);
        for (int h = 0; h < 2; ++h) wsum[h] = _mm256_dpbusd_avx_epi32(wsum[h], ones_u8, w[h]);
        for (int r = 0; r < R; ++r) {
          const __m256i x = x4(r, t);
          for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_dpbusd_avx_epi32(dot[r][h], x, w[h]);
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256i offset = _mm256_slli_epi32(wsum[h], 7);  // 128 sum q
        for (int r = 0; r < R; ++r) dot[r][h] = _mm256_sub_epi32(dot[r][h], offset);
      }
    } else {
      for (int t = 0; t < 8; ++t) {
        __m256i w[2];
        int4_quad_u8(bytes, t, w);
        for (int r = 0; r < R; ++r) {
          const __m256i x = x4(r, t);
          for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_dpbusd_avx_epi32(dot[r][h], w[h], x);
        }
      }
    }
#else
    static_assert(!kInt8, "int8 weights take the int16 code without VNNI");
    __m256i pairs[R][2];
    for (int r = 0; r < R; ++r) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
      __m256i w[2];
      int4_quad_u8(bytes, t, w);
      for (int r = 0; r < R; ++r) {
        const __m256i x = x4(r, t);
        for (int h = 0; h < 2; ++h)
          pairs[r][h] = _mm256_add_epi16(pairs[r][h], _mm256_maddubs_epi16(w[h], x));
      }
    }
    const __m256i ones16 = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_madd_epi16(pairs[r][h], ones16);
#endif
    __m256 scale[2] = {scales.lanes8(g, 0), scales.lanes8(g, 1)};
    if (kInt8) {  // the lane order of int8_quad_s8: 0-3 | 8-11 and 4-7 | 12-15
      const __m256 natural[2] = {scale[0], scale[1]};
      scale[0] = _mm256_permute2f128_ps(natural[0], natural[1], 0x20);
      scale[1] = _mm256_permute2f128_ps(natural[0], natural[1], 0x31);
    }
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * groups + g;
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]),
                                    _mm256_mul_ps(scale[h], _mm256_set1_ps(a.scales[at])), acc[r][h]);
      }
    if (!kInt8)
      for (int h = 0; h < 2; ++h) {
        const __m256 lowest = mins.lanes8(g, h);
        for (int r = 0; r < R; ++r)
          acc[r][h] = _mm256_fmadd_ps(lowest, _mm256_set1_ps(a.sums[(m0 + r) * groups + g]),
                                      acc[r][h]);
      }
  }
  for (int r = 0; r < R; ++r) {
    float* o = out + (m0 + r) * out_stride;
    if (kInt8) {
      _mm256_storeu_ps(o, _mm256_permute2f128_ps(acc[r][0], acc[r][1], 0x20));
      _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(acc[r][0], acc[r][1], 0x31));
    } else {
      _mm256_storeu_ps(o, acc[r][0]);
      _mm256_storeu_ps(o + 8, acc[r][1]);
    }
  }
}
#endif

#if defined(PAGEDSERVE_X8_INT4)
constexpr bool kX8Int4 = true;
#else
constexpr bool kX8Int4 = false;
#endif
#if defined(PAGEDSERVE_X8_INT8)
constexpr bool kX8Int8 = true;
#else
constexpr bool kX8Int8 = false;
#endif
// Whether this build has an 8-bit-activation kernel for the format.
template <bool kInt8>
constexpr bool kHasX8Kernel = kInt8 ? kX8Int8 : kX8Int4;

// The passes over one block's rows: 8 at a time, the rest in one pass (a block's weights
// are widened once per pass, so 3 rows in one pass cost about one row's loads, not three).
// `pass` is called as pass(std::integral_constant<int, R>{}, m0).
template <typename Pass>
inline void row_passes(int64_t rows, const Pass& pass) {
  int64_t m0 = 0;
  for (; m0 + 8 <= rows; m0 += 8) pass(std::integral_constant<int, 8>{}, m0);
  switch (rows - m0) {
    case 7: pass(std::integral_constant<int, 7>{}, m0); break;
    case 6: pass(std::integral_constant<int, 6>{}, m0); break;
    case 5: pass(std::integral_constant<int, 5>{}, m0); break;
    case 4: pass(std::integral_constant<int, 4>{}, m0); break;
    case 3: pass(std::integral_constant<int, 3>{}, m0); break;
    case 2: pass(std::integral_constant<int, 2>{}, m0); break;
    case 1: pass(std::integral_constant<int, 1>{}, m0); break;
    default: break;
  }
}

// out [M, N] = x [M, K] @ W.T for W in blocks (mins: int4 only, else empty).
template <bool kInt8>
at::Tensor blocked_linear(const at::Tensor& x, const uint8_t* w, int64_t blocks, int64_t groups,
                          GroupLanes s, GroupLanes mn) {
  const int64_t cols = groups * kGroup;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == cols, "x has ", x.size(1), " columns, the weight ", cols);
  const int64_t rows = x.size(0), num_out = blocks * kLanes;
  const int bits = activation_bits();  // once per call: a switch mid-call does not split it
  at::Tensor out = at::empty({rows, num_out}, x.options());
  float* op = out.data_ptr<float>();
  constexpr int64_t bytes = kBytesPerGroup<kInt8>;
  // Block b's weights, scales, mins (int4) and outputs.
  auto block_w = [&](int64_t b) { return w + b * groups * bytes; };
  auto block_s = [&](int64_t b) { return s.block(b, groups); };
  auto block_m = [&](int64_t b) { return kInt8 ? GroupLanes{} : mn.block(b, groups); };
  if constexpr (kHasX8Kernel<kInt8>) {
    if (bits == 8) {
      const Int8Activations a = quantize_activations_int8(x.data_ptr<float>(), rows, cols,
                                                          /*offset=*/kInt8);
      pagedserve::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          row_passes(rows, [&](auto r, int64_t m0) {
            block_rows_x8<kInt8, decltype(r)::value>(block_w(b), block_s(b), block_m(b), groups, a,
                                                     cols, m0, op + b * kLanes, num_out);
          });
        }
      });
      return out;
    }
  }
  const QuantizedActivations a = quantize_activations(x.data_ptr<float>(), rows, cols,
                                                      /*pairs=*/false, /*transposed=*/false,
                                                      activation_levels(bits));
  pagedserve::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      row_passes(rows, [&](auto r, int64_t m0) {
        block_rows<kInt8, decltype(r)::value>(block_w(b), block_s(b), block_m(b), groups, a, cols,
                                              m0, op + b * kLanes, num_out);
      });
    }
  });
  return out;
}

// Blocked scales/mins: contiguous float16 [blocks, groups, 16], or uint8 super-blocks
// [blocks, groups / 8, 160] (GroupLanes).
GroupLanes group_lanes(const at::Tensor& t, int64_t blocks, int64_t groups, const char* what) {
  TORCH_CHECK(t.defined() && t.is_contiguous() && t.dim() == 3 && t.size(0) == blocks,
              "blocked ", what, " must be a contiguous [N / 16, ...] tensor");
  if (t.scalar_type() == at::kByte) {
    TORCH_CHECK(groups % 8 == 0 && t.size(1) == groups / 8 &&
                    t.size(2) == GroupLanes::kSuperBytes,
                "blocked ", what, " in super-blocks must be uint8 [N / 16, K / 256, 160]");
    return {t.data_ptr<uint8_t>(), true};
  }
  TORCH_CHECK(t.scalar_type() == at::kHalf && t.size(1) == groups && t.size(2) == kLanes,
              "blocked ", what, " must be float16 [N / 16, K / 32, 16]");
  return {reinterpret_cast<const uint8_t*>(halves(t)), false};
}

void check_blocked(const at::Tensor& packed, at::ScalarType dtype, int64_t bytes,
                   const char* what) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == dtype && packed.is_contiguous() &&
                  packed.size(2) == bytes,
              "blocked ", what, " weights must be a contiguous [N / 16, K / 32, ", bytes, "] tensor");
}

}  // namespace

bool is_blocked(const at::Tensor& packed) { return packed.dim() == 3; }

void check_blocked_weight(const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& mins, int64_t bits) {
  if (bits == 4) {
    check_blocked(packed, at::kByte, kBytesPerGroup<false>, "int4 (uint8)");
  } else {
    check_blocked(packed, at::kChar, kBytesPerGroup<true>, "int8 (int8)");
  }
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  group_lanes(scales, blocks, groups, "scales");
  if (bits == 4) group_lanes(mins, blocks, groups, "int4 mins");
}

at::Tensor blocked_int4_linear(at::Tensor x, at::Tensor packed, at::Tensor scales,
                               at::Tensor mins) {
  check_blocked(packed, at::kByte, kBytesPerGroup<false>, "int4 (uint8)");
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  return blocked_linear<false>(x, packed.data_ptr<uint8_t>(), blocks, groups,
                               group_lanes(scales, blocks, groups, "int4 scales"),
                               group_lanes(mins, blocks, groups, "int4 mins"));
}

at::Tensor blocked_int8_linear(at::Tensor x, at::Tensor packed, at::Tensor scales) {
  check_blocked(packed, at::kChar, kBytesPerGroup<true>, "int8 (int8)");
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  return blocked_linear<true>(x, reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>()),
                              blocks, groups, group_lanes(scales, blocks, groups, "int8 scales"),
                              GroupLanes{});
}

// Block `block`'s 16 rows as float32 [16, K] (the tiled path's weights). For each group
// and quad, the low and high nibbles interleaved by 16-bit units are, per 128-bit lane,
// 4 rows x their 4 values in column order: [j v0 v1 v2 v3, j+1 v0 .. v3, ...].
void decode_blocked_int4(const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t block, float* dst) {
  const int64_t groups = packed.size(1), cols = groups * kGroup;
  const uint8_t* bytes = packed.data_ptr<uint8_t>() + block * groups * kBytesPerGroup<false>;
  const int64_t blocks = packed.size(0);
  const GroupLanes s = group_lanes(scales, blocks, groups, "int4 scales").block(block, groups);
  const GroupLanes mn = group_lanes(mins, blocks, groups, "int4 mins").block(block, groups);
  for (int64_t g = 0; g < groups; ++g) {
    float scale[kLanes], lowest[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      scale[j] = s.lane(g, j);
      lowest[j] = mn.lane(g, j);
    }
#if defined(__AVX512F__)
    // Per 4 rows j .. j + 3: 16 floats [scale[j] x 4, scale[j + 1] x 4, ...], once a group.
    const __m512i repeat4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 scale4[4], lowest4[4];
    for (int i = 0; i < 4; ++i) {
      scale4[i] = _mm512_permutexvar_ps(repeat4, _mm512_castps128_ps512(_mm_loadu_ps(scale + 4 * i)));
      lowest4[i] = _mm512_permutexvar_ps(repeat4, _mm512_castps128_ps512(_mm_loadu_ps(lowest + 4 * i)));
    }
#endif
    for (int t = 0; t < 8; ++t) {
      const uint8_t* p = bytes + g * kBytesPerGroup<false> + 32 * t;
#if defined(__AVX2__)
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      const __m256i lo = _mm256_and_si256(v, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      // 128-bit lane 0: rows 0-3 (unpacklo) and 4-7 (unpackhi); lane 1: rows 8-11, 12-15.
      const __m256i quads[2] = {_mm256_unpacklo_epi16(lo, hi), _mm256_unpackhi_epi16(lo, hi)};
      for (int half = 0; half < 2; ++half)
        for (int lane = 0; lane < 2; ++lane) {
          const __m128i rows4 = lane == 0 ? _mm256_castsi256_si128(quads[half])
                                          : _mm256_extracti128_si256(quads[half], 1);
          const int j0 = 8 * lane + 4 * half;
          float* y = dst + j0 * cols + g * kGroup + 4 * t;
#if defined(__AVX512F__)
          const __m512 values = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(rows4)),
                                                scale4[j0 / 4], lowest4[j0 / 4]);
          _mm_storeu_ps(y, _mm512_extractf32x4_ps(values, 0));
          _mm_storeu_ps(y + cols, _mm512_extractf32x4_ps(values, 1));
          _mm_storeu_ps(y + 2 * cols, _mm512_extractf32x4_ps(values, 2));
          _mm_storeu_ps(y + 3 * cols, _mm512_extractf32x4_ps(values, 3));
#else
          for (int i = 0; i < 4; i += 2) {  // rows j0 + i, j0 + i + 1: bytes 4 i .. 4 i + 7
            const int j = j0 + i;
            const __m256 q = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(i == 0 ? rows4 : _mm_srli_si128(rows4, 8)));
            const __m256 values = _mm256_fmadd_ps(
                q, _mm256_set_m128(_mm_set1_ps(scale[j + 1]), _mm_set1_ps(scale[j])),
                _mm256_set_m128(_mm_set1_ps(lowest[j + 1]), _mm_set1_ps(lowest[j])));
            _mm_storeu_ps(y + i * cols, _mm256_castps256_ps128(values));
            _mm_storeu_ps(y + (i + 1) * cols, _mm256_extractf128_ps(values, 1));
          }
#endif
        }
#else
      for (int j = 0; j < kLanes; ++j) {
        float* y = dst + j * cols + g * kGroup + 4 * t;
        y[0] = lowest[j] + scale[j] * static_cast<float>(p[2 * j] & 15);
        y[1] = lowest[j] + scale[j] * static_cast<float>(p[2 * j + 1] & 15);
        y[2] = lowest[j] + scale[j] * static_cast<float>(p[2 * j] >> 4);
        y[3] = lowest[j] + scale[j] * static_cast<float>(p[2 * j + 1] >> 4);
      }
#endif
    }
  }
}

// The same for blocked int8: per group the bytes are [pair p][lane j][2], a 16 x 16
// matrix of 16-bit words M[p][j] (row j's columns 2p, 2p + 1), so row j's 32 weights are
// column j of M (a transpose), then scaled: W[16 b + j, 32 g + k] = scales[b, g, j] * q.
void decode_blocked_int8(const at::Tensor& packed, const at::Tensor& scales, int64_t block,
                         float* dst) {
  const int64_t groups = packed.size(1), cols = groups * kGroup;
  constexpr int64_t bytes_per_group = kBytesPerGroup<true>;
  const int8_t* bytes = packed.data_ptr<int8_t>() + block * groups * bytes_per_group;
  const GroupLanes s =
      group_lanes(scales, packed.size(0), groups, "int8 scales").block(block, groups);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // Register i holds pairs 2i and 2i + 1 (M[2i][0..15], M[2i + 1][0..15]). One vpermw
  // interleaves them, dword j = (M[2i][j], M[2i + 1][j]): row j's columns 4i .. 4i + 3,
  // and qword k = rows 2k, 2k + 1. An 8 x 8 transpose of qwords (3 stages of vpermt2q:
  // at stage s, registers a and a + 2^s swap the halves whose qword index has bit s
  // set) leaves in register k qword i = (row 2k, row 2k + 1) columns 4i .. 4i + 3, and
  // one vpermd makes it row 2k's 32 bytes, then row 2k + 1's.
  alignas(64) int16_t interleave[32];
  for (int j = 0; j < 16; ++j) interleave[2 * j] = j, interleave[2 * j + 1] = 16 + j;
  const __m512i pairs_to_rows = _mm512_load_si512(interleave);
  __m512i stage_low[3], stage_high[3];
  for (int st = 0; st < 3; ++st) {
    const int stride = 1 << st;
    alignas(64) int64_t low[8], high[8];
    for (int k = 0; k < 8; ++k) {
      const bool upper = k & stride;
      low[k] = upper ? 8 + k - stride : k;   // from register a, or b's lower qword
      high[k] = upper ? 8 + k : k + stride;  // a's upper qword, or from register b
    }
    stage_low[st] = _mm512_load_si512(low);
    stage_high[st] = _mm512_load_si512(high);
  }
  const __m512i rows_apart = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i r[8];
    for (int i = 0; i < 8; ++i)
      r[i] = _mm512_permutexvar_epi16(
          pairs_to_rows, _mm512_loadu_si512(bytes + g * bytes_per_group + 64 * i));
    for (int st = 0; st < 3; ++st)
      for (int a = 0; a < 8; ++a)
        if (!(a & (1 << st))) {
          const int b = a + (1 << st);
          const __m512i low = _mm512_permutex2var_epi64(r[a], stage_low[st], r[b]);
          r[b] = _mm512_permutex2var_epi64(r[a], stage_high[st], r[b]);
          r[a] = low;
        }
    for (int k = 0; k < 8; ++k) {
      const __m512i two_rows = _mm512_permutexvar_epi32(rows_apart, r[k]);
      // Quarter c: 16 weights of row 2k + c / 2 (the index of an extract is an immediate).
      const __m128i quarters[4] = {
          _mm512_extracti32x4_epi32(two_rows, 0), _mm512_extracti32x4_epi32(two_rows, 1),
          _mm512_extracti32x4_epi32(two_rows, 2), _mm512_extracti32x4_epi32(two_rows, 3)};
      for (int c = 0; c < 4; ++c) {
        const int j = 2 * k + c / 2;
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(quarters[c]));
        _mm512_storeu_ps(dst + j * cols + g * kGroup + 16 * (c % 2),
                         _mm512_mul_ps(q, _mm512_set1_ps(s.lane(g, j))));
      }
    }
  }
#else
  for (int64_t g = 0; g < groups; ++g)
    for (int j = 0; j < kLanes; ++j) {
      const float scale = s.lane(g, j);
      float* y = dst + j * cols + g * kGroup;
      for (int k = 0; k < kGroup; ++k)  // column k = pair k / 2, its value k % 2
        y[k] = scale * static_cast<float>(bytes[g * bytes_per_group + (k / 2) * 32 + 2 * j + k % 2]);
    }
#endif
}
