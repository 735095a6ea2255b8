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
// or K-quant super-blocks of 8 groups (GroupLanes below). GGUF Q4_K is repacked exactly into
// the int4 layout with such scales; GGUF Q6_K into a six-bit form of the int8 layout (q - 32,
// 384 bytes per group, decoded to the 512 a group at a time: decode_q6k_group) with a scale
// per 16 columns.
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
#include "float_rows.h"
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

// GGUF Q6_K repacked (engine.models.quant.block_q6k_values): the int8 layout's weights
// q - 32 (q 0..63) in 6 bits, 48 bytes per quad t of a group instead of 64, decoded to the
// int8 quad bytes before use. Of the int8 quad's 64 byte positions P (P = 32 p + 2 j + i:
// lane j's column 4 t + 2 p + i), bytes 0..31 of the stored quad hold the low nibbles
// (position b in the low nibble of byte b, position 32 + b in its high nibble, as the int4
// layout pairs them) and bytes 32..47 the high two bits: those of position P are bits
// 2 (P / 16), 2 (P / 16) + 1 of byte 32 + P % 16.
// Example: stored byte 0 = 0x5A, byte 32 = 0x12: position 0 is 0xA | 2 << 4 = 42 (weight
// 10), position 32 (bits 4, 5) is 0x5 | 1 << 4 = 21 (weight -11).
constexpr int64_t kQ6kQuadBytes = 48, kQ6kGroupBytes = 8 * kQ6kQuadBytes;

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Quad t of a Q6_K group as the int8 layout's 64 bytes of that quad.
inline __m512i q6k_quad(const uint8_t* group, int t) {
  const uint8_t* src = group + t * kQ6kQuadBytes;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m512i nibbles = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low4)),
                                             _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), 1);
  // 128-bit lane c holds positions 16 c .. 16 c + 15: their bits sit 2 c up.
  const __m512i high =
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32)));
  const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 0x20002, 0x20002, 0x20002, 0x20002,
                                           0x40004, 0x40004, 0x40004, 0x40004,
                                           0x60006, 0x60006, 0x60006, 0x60006);
  const __m512i top = _mm512_and_si512(_mm512_srlv_epi16(high, shifts), _mm512_set1_epi8(3));
  return _mm512_sub_epi8(_mm512_or_si512(nibbles, _mm512_slli_epi16(top, 4)),
                         _mm512_set1_epi8(32));
}
#endif
#if defined(__AVX2__)
// The same in two halves: q[0] = positions 0..31, q[1] = 32..63.
inline void q6k_quad(const uint8_t* group, int t, __m256i q[2]) {
  const uint8_t* src = group + t * kQ6kQuadBytes;
  const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i high =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32)));
  // positions 0..31: bits 0, 1 (the first 16) and 2, 3; positions 32..63: 4, 5 and 6, 7
  const __m256i top01 =
      _mm256_and_si256(_mm256_blend_epi32(high, _mm256_srli_epi16(high, 2), 0xF0), three);
  const __m256i top23 = _mm256_and_si256(
      _mm256_blend_epi32(_mm256_srli_epi16(high, 4), _mm256_srli_epi16(high, 6), 0xF0), three);
  const __m256i bias = _mm256_set1_epi8(32);
  q[0] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(v, low4), _mm256_slli_epi16(top01, 4)),
                         bias);
  q[1] = _mm256_sub_epi8(
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), _mm256_slli_epi16(top23, 4)),
      bias);
}
#endif

// One Q6_K group (384 bytes) -> the int8 layout's 512 bytes of that group.
inline void decode_q6k_group(const uint8_t* src, uint8_t* dst) {
  for (int t = 0; t < 8; ++t) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    _mm512_storeu_si512(dst + 64 * t, q6k_quad(src, t));
#elif defined(__AVX2__)
    __m256i q[2];
    q6k_quad(src, t, q);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 64 * t), q[0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 64 * t + 32), q[1]);
#else
    const uint8_t* quad = src + t * kQ6kQuadBytes;
    for (int position = 0; position < 64; ++position) {
      const uint8_t nibble = position < 32 ? quad[position] & 15 : quad[position - 32] >> 4;
      const uint8_t top = (quad[32 + position % 16] >> (2 * (position / 16))) & 3;
      dst[64 * t + position] = static_cast<uint8_t>((nibble | top << 4) - 32);
    }
#endif
  }
}

// Bytes of one block's group as stored: Q6_K's 384 (6-bit), else 256 (int4) / 512 (int8).
constexpr int64_t group_stride(bool int8, bool q6k) {
  return q6k ? kQ6kGroupBytes : int8 ? kBytesPerGroup<true> : kBytesPerGroup<false>;
}

// Group g's bytes in a block.
template <bool kInt8, bool kQ6k>
inline const uint8_t* group_at(const uint8_t* block, int64_t g) {
  return block + g * group_stride(kInt8, kQ6k);
}

// Asks for one group's worth of lines kPrefetchAheadBytes past group g, while group g is
// computed. Each thread streams its own run of blocks, and the cores' stream prefetchers
// stop at every 4 KiB page: without this, each page's first lines stall a thread on memory.
// 3 KiB ~ memory latency times one thread's share of the bandwidth. Same-process A/Bs on a
// Zen 5 (AVX-512 VNNI, int8 activations), 2 KiB ahead against none: the default model's
// decode 0.90-0.94x the time a step at 1 row, 0.92x at 8 and 0.93x at 32 rows, the 1B
// Q4_0's 0.89x at 1 row; 3 KiB against 2 KiB 0.98x on both, 4 KiB 1.04x on the 1B. A
// prefetch past a run's end reads the next run, or nothing (prefetches never fault).
constexpr int64_t kPrefetchAheadBytes = 3072;

template <bool kInt8, bool kQ6k>
inline void prefetch_ahead(const uint8_t* block, int64_t g) {
  const uint8_t* ahead = group_at<kInt8, kQ6k>(block, g) + kPrefetchAheadBytes;
  for (int64_t line = 0; line < group_stride(kInt8, kQ6k); line += 64)
    __builtin_prefetch(ahead + line, 0, 3);
}

// Group g's bytes as the kernels read them: in place, or (kQ6k) decoded into `buffer` (512
// bytes of the int8 layout; decoding a group at a time measured faster here than decoding
// each quad into registers where it is used).
template <bool kInt8, bool kQ6k>
inline const uint8_t* group_bytes(const uint8_t* block, int64_t g, uint8_t* buffer) {
  if constexpr (kQ6k) {
    decode_q6k_group(group_at<kInt8, kQ6k>(block, g), buffer);
    return buffer;
  }
  return group_at<kInt8, kQ6k>(block, g);
}

// Where one block's per-group scales (or int4's mins) come from; lane j = output row
// 16 b + j. A group's scale covers its 32 columns, or (`segments` 2) each half of them.
// Three forms, told apart by the tensor (group_lanes):
//   float16 [G, 16] (quant.py's int4/int8, the repacked 32-block GGUF types);
//   super-blocks of 8 groups (256 columns) with a float16 d[16] in bytes 0..31, then one
//   8-bit k per segment and lane, the value being d[j] * k, exact in float32 (an 11-bit
//   significand times an 8-bit integer). engine.models.gguf_weight.repack builds them:
//   - GGUF Q4_K, uint8 [G / 8, 160]: k[i][j] unsigned (6-bit sc) for group 8 s + i, one
//     segment; the mins hold -dmin and m the same way;
//   - GGUF Q6_K, uint8 [G / 8, 288]: k[2 i + h][j] signed (int8 sc) for half h of group
//     8 s + i (columns 16 h .. 16 h + 15 of it): two segments.
//   Example (Q4_K): d[3] = 0.5, k[2][3] = 7: lane 3 of group 8 s + 2 is 3.5.
// Every path (scalar, 8 or 16 lanes) forms the same float32 values.
struct GroupLanes {
  static constexpr int64_t kQ4kBytes = 160, kQ6kBytes = 288;
  const uint8_t* p = nullptr;
  int64_t super_bytes = 0;  // 0: float16 lanes; else kQ4kBytes or kQ6kBytes
  int segments = 1;

  // Block b's lanes, for a weight of `groups` groups per row (none of none: int8 mins).
  GroupLanes block(int64_t b, int64_t groups) const {
    if (p == nullptr) return {};
    const int64_t bytes = super_bytes ? groups / 8 * super_bytes : groups * kLanes * 2;
    return {p + b * bytes, super_bytes, segments};
  }
  // Super-block lanes: the 16 k of group g's segment `seg`.
  const uint8_t* k_of(int64_t g, int seg) const {
    return p + (g / 8) * super_bytes + 32 + 16 * (segments * (g % 8) + seg);
  }
  const uint8_t* d_of(int64_t g) const { return p + (g / 8) * super_bytes; }
  float lane(int64_t g, int j, int seg = 0) const {
    if (!super_bytes) return half_to_float(reinterpret_cast<const uint16_t*>(p)[g * kLanes + j]);
    const uint8_t k = k_of(g, seg)[j];
    return half_to_float(reinterpret_cast<const uint16_t*>(d_of(g))[j]) *
           static_cast<float>(segments == 2 ? static_cast<int8_t>(k) : k);
  }
#if defined(__AVX512F__) && defined(__F16C__)
  __m512 lanes16(int64_t g, int seg = 0) const {
    if (!super_bytes)
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * g)));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d_of(g))));
    const __m128i k = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k_of(g, seg)));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(segments == 2 ? _mm512_cvtepi8_epi32(k)
                                                             : _mm512_cvtepu8_epi32(k)));
  }
#endif
#if defined(__AVX2__) && defined(__F16C__)
  // Lanes 8 h .. 8 h + 7.
  __m256 lanes8(int64_t g, int h, int seg = 0) const {
    if (!super_bytes)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * g + 16 * h)));
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d_of(g) + 16 * h)));
    const __m128i k = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k_of(g, seg) + 8 * h));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(segments == 2 ? _mm256_cvtepi8_epi32(k)
                                                             : _mm256_cvtepu8_epi32(k)));
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

// out[m0 .. m0 + R - 1, 16 b .. 16 b + 15] from one block's bytes (mins: int4, and int8
// where mins.p is set: GGUF Q5_K). kQ6k: Q6_K's six-bit layout (GGUF Q6_K, Q3_K, Q5_K: weights
// decoded a group at a time, group_bytes); kSeg scale segments per group, each over 8 / kSeg
// quads (Q6_K, Q3_K: 2).
template <bool kInt8, int R, bool kQ6k = false, int kSeg = kQ6k ? 2 : 1>
void block_rows(const uint8_t* block, GroupLanes scales, GroupLanes mins,
                int64_t groups, const QuantizedActivations& a, int64_t cols, int64_t m0, float* out,
                int64_t out_stride) {
  __m512 acc[R];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_ahead<kInt8, kQ6k>(block, g);
    alignas(64) uint8_t q6k_group[kQ6k ? 512 : 1];
    const uint8_t* bytes = group_bytes<kInt8, kQ6k>(block, g, q6k_group);
    for (int seg = 0; seg < kSeg; ++seg) {
      __m512i dot[R];
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
      #pragma GCC unroll 8
      for (int t = seg * 8 / kSeg; t < (seg + 1) * 8 / kSeg; ++t) {
        __m512i w01, w23;
        quad_weights<kInt8>(bytes, t, w01, w23);
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int32_t* pairs = reinterpret_cast<const int32_t*>(
              a.values.data() + (m0 + r) * cols + g * kGroup + 4 * t);
          dot[r] = pair_dot(pair_dot(dot[r], w01, pairs[0]), w23, pairs[1]);
        }
      }
      const __m512 scale = scales.lanes16(g, seg);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * groups + g;
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                                 _mm512_mul_ps(scale, _mm512_set1_ps(a.scales[at])), acc[r]);
      }
    }
    if (!kInt8 || mins.p != nullptr) {
      const __m512 lowest = mins.lanes16(g);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(lowest, _mm512_set1_ps(a.sums[(m0 + r) * groups + g]), acc[r]);
    }
  }
  #pragma GCC unroll 8
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
template <bool kInt8, int R, bool kQ6k = false, int kSeg = kQ6k ? 2 : 1>
void block_rows(const uint8_t* block, GroupLanes scales, GroupLanes mins,
                int64_t groups, const QuantizedActivations& a, int64_t cols, int64_t m0, float* out,
                int64_t out_stride) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_ahead<kInt8, kQ6k>(block, g);
    alignas(64) uint8_t q6k_group[kQ6k ? 512 : 1];
    const uint8_t* bytes = group_bytes<kInt8, kQ6k>(block, g, q6k_group);
    for (int seg = 0; seg < kSeg; ++seg) {
      __m256i dot[R][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
      for (int t = seg * 8 / kSeg; t < (seg + 1) * 8 / kSeg; ++t) {
        __m256i w[2][2];
        quad_weights<kInt8>(bytes, t, w);
        for (int r = 0; r < R; ++r) {
          const int32_t* pairs = reinterpret_cast<const int32_t*>(
              a.values.data() + (m0 + r) * cols + g * kGroup + 4 * t);
          const __m256i x01 = _mm256_set1_epi32(pairs[0]), x23 = _mm256_set1_epi32(pairs[1]);
          for (int h = 0; h < 2; ++h)
            dot[r][h] = _mm256_add_epi32(
                dot[r][h], _mm256_add_epi32(_mm256_madd_epi16(w[h][0], x01),
                                            _mm256_madd_epi16(w[h][1], x23)));
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = scales.lanes8(g, h, seg);
        for (int r = 0; r < R; ++r) {
          const int64_t at = (m0 + r) * groups + g;
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]),
                                      _mm256_mul_ps(scale, _mm256_set1_ps(a.scales[at])), acc[r][h]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      if (!kInt8 || mins.p != nullptr) {
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

template <bool kInt8, int R, bool kQ6k = false, int kSeg = kQ6k ? 2 : 1>
void block_rows(const uint8_t* block, GroupLanes scales, GroupLanes mins,
                int64_t groups, const QuantizedActivations& a, int64_t cols, int64_t m0, float* out,
                int64_t out_stride) {
  alignas(64) uint8_t q6k_group[kQ6k ? 512 : 1];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kLanes; ++j) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = (m0 + r) * groups + g;
        const uint8_t* bytes = group_bytes<kInt8, kQ6k>(block, g, q6k_group);
        for (int seg = 0; seg < kSeg; ++seg) {
          int32_t dot = 0;
          for (int t = seg * 8 / kSeg; t < (seg + 1) * 8 / kSeg; ++t) {
            int32_t q[4];
            quad_lane<kInt8>(bytes, t, j, q);
            const int16_t* x = a.values.data() + (m0 + r) * cols + g * kGroup + 4 * t;
            dot += q[0] * x[0] + q[1] * x[1] + q[2] * x[2] + q[3] * x[3];
          }
          acc = std::fma(static_cast<float>(dot), scales.lane(g, j, seg) * a.scales[at], acc);
        }
        if (!kInt8 || mins.p != nullptr) acc = std::fma(mins.lane(g, j), a.sums[at], acc);
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
template <bool kInt8, int R, bool kQ6k = false, int kSeg = kQ6k ? 2 : 1>
void block_rows_x8(const uint8_t* block, GroupLanes scales, GroupLanes mins,
                   int64_t groups, const Int8Activations& a, int64_t cols, int64_t m0, float* out,
                   int64_t out_stride) {
  __m512 acc[R];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
#if defined(PAGEDSERVE_X8_INT8)
  alignas(64) int16_t interleave[32];
  for (int j = 0; j < 16; ++j) interleave[2 * j] = j, interleave[2 * j + 1] = 16 + j;
  const __m512i words_to_lanes = _mm512_load_si512(interleave);
  const __m512i ones_u8 = _mm512_set1_epi8(1);
#endif
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_ahead<kInt8, kQ6k>(block, g);
    alignas(64) uint8_t q6k_group[kQ6k ? 512 : 1];
    const uint8_t* bytes = group_bytes<kInt8, kQ6k>(block, g, q6k_group);
    // x's four bytes of quad t, row r: one int32, broadcast.
    auto x4 = [&](int r, int t) {
      return _mm512_set1_epi32(
          reinterpret_cast<const int32_t*>(a.values.data() + (m0 + r) * cols + g * kGroup)[t]);
    };
    for (int seg = 0; seg < kSeg; ++seg) {  // quads t0 .. t1 - 1 share a scale
      const int t0 = seg * 8 / kSeg, t1 = (seg + 1) * 8 / kSeg;
      __m512i dot[R];
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
#if defined(PAGEDSERVE_X8_INT8)
      if (kInt8) {
        __m512i wsum = _mm512_setzero_si512();
        #pragma GCC unroll 8
        for (int t = t0; t < t1; ++t) {
          const __m512i w = int8_quad_s8(bytes, t, words_to_lanes);
          wsum = dpbusd(wsum, ones_u8, w);
          #pragma GCC unroll 8
          for (int r = 0; r < R; ++r) dot[r] = dpbusd(dot[r], x4(r, t), w);
        }
        const __m512i offset = _mm512_slli_epi32(wsum, 7);  // 128 sum q
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) dot[r] = _mm512_sub_epi32(dot[r], offset);
      } else {
        #pragma GCC unroll 8
        for (int t = t0; t < t1; ++t) {
          const __m512i w = int4_quad_u8(bytes, t);
          #pragma GCC unroll 8
          for (int r = 0; r < R; ++r) dot[r] = dpbusd(dot[r], w, x4(r, t));
        }
      }
#else
      static_assert(!kInt8, "int8 weights take the int16 code without VNNI");
      __m512i pairs[R];
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) pairs[r] = _mm512_setzero_si512();
      #pragma GCC unroll 8
      for (int t = t0; t < t1; ++t) {
        const __m512i w = int4_quad_u8(bytes, t);
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          pairs[r] = _mm512_add_epi16(pairs[r], _mm512_maddubs_epi16(w, x4(r, t)));
      }
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) dot[r] = _mm512_madd_epi16(pairs[r], _mm512_set1_epi16(1));
#endif
      const __m512 scale = scales.lanes16(g, seg);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * groups + g;
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                                 _mm512_mul_ps(scale, _mm512_set1_ps(a.scales[at])), acc[r]);
      }
    }
    if (!kInt8 || mins.p != nullptr) {
      const __m512 lowest = mins.lanes16(g);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(lowest, _mm512_set1_ps(a.sums[(m0 + r) * groups + g]), acc[r]);
    }
  }
  #pragma GCC unroll 8
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
template <bool kInt8, int R, bool kQ6k = false, int kSeg = kQ6k ? 2 : 1>
void block_rows_x8(const uint8_t* block, GroupLanes scales, GroupLanes mins,
                   int64_t groups, const Int8Activations& a, int64_t cols, int64_t m0, float* out,
                   int64_t out_stride) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_ahead<kInt8, kQ6k>(block, g);
    alignas(64) uint8_t q6k_group[kQ6k ? 512 : 1];
    const uint8_t* bytes = group_bytes<kInt8, kQ6k>(block, g, q6k_group);
    auto x4 = [&](int r, int t) {
      return _mm256_set1_epi32(
          reinterpret_cast<const int32_t*>(a.values.data() + (m0 + r) * cols + g * kGroup)[t]);
    };
    for (int seg = 0; seg < kSeg; ++seg) {  // quads t0 .. t1 - 1 share a scale
      const int t0 = seg * 8 / kSeg, t1 = (seg + 1) * 8 / kSeg;
      __m256i dot[R][2];
#if defined(PAGEDSERVE_X8_INT8)
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
      if (kInt8) {
        const __m256i ones_u8 = _mm256_set1_epi8(1);
        __m256i wsum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int t = t0; t < t1; ++t) {
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
        for (int t = t0; t < t1; ++t) {
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
      for (int t = t0; t < t1; ++t) {
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
      __m256 scale[2] = {scales.lanes8(g, 0, seg), scales.lanes8(g, 1, seg)};
      if (kInt8) {  // the lane order of int8_quad_s8: 0-3 | 8-11 and 4-7 | 12-15
        const __m256 natural[2] = {scale[0], scale[1]};
        scale[0] = _mm256_permute2f128_ps(natural[0], natural[1], 0x20);
        scale[1] = _mm256_permute2f128_ps(natural[0], natural[1], 0x31);
      }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) {
          const int64_t at = (m0 + r) * groups + g;
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]),
                                      _mm256_mul_ps(scale[h], _mm256_set1_ps(a.scales[at])),
                                      acc[r][h]);
        }
    }
    if (!kInt8 || mins.p != nullptr) {
      __m256 lowest[2] = {mins.lanes8(g, 0), mins.lanes8(g, 1)};
      if (kInt8) {  // int8's lane order, as the scales above (GGUF Q5_K's mins)
        const __m256 natural[2] = {lowest[0], lowest[1]};
        lowest[0] = _mm256_permute2f128_ps(natural[0], natural[1], 0x20);
        lowest[1] = _mm256_permute2f128_ps(natural[0], natural[1], 0x31);
      }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r)
          acc[r][h] = _mm256_fmadd_ps(lowest[h], _mm256_set1_ps(a.sums[(m0 + r) * groups + g]),
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
// `pass` is called as pass(std::integral_constant<int, R>{}, m0) for rows first .. first +
// rows - 1.
template <typename Pass>
inline void row_passes(int64_t first, int64_t rows, const Pass& pass) {
  int64_t m0 = first;
  rows += first;
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

// Rows of x per tile. Each thread runs its blocks over one tile of rows, then the next, so a
// tile's rounded activations stay in L2 while the blocks pass over them: over all M rows at
// once, a prefill chunk's activations (M x K bytes, 8 MB for 1,024 rows of the 1B's down
// projection) left L2 and each block's pass read them from L3 (int8 activations on a Zen 5,
// ms per 1B layer: 0.11 per row at 128 rows, 0.145 at 1,024 before the tiles). A tile of
// ~256 KB: K = 2,048 and int8 values, 128 rows; K = 8,192, 32 rows (at least 8 rows, a
// multiple of 8). The weights are read once per tile; one row's result does not depend on
// the tiling (each (m, n) takes the same instructions), so batch invariance holds.
inline int64_t row_tile(int64_t cols, int64_t bytes_per_value) {
  constexpr int64_t kTileBytes = int64_t{256} << 10;
  return std::max<int64_t>(8, kTileBytes / (cols * bytes_per_value) / 8 * 8);
}

// Where the kernels write out [M, N] in float32: out itself, or (a bfloat16 / float16 out)
// a float32 buffer that round(begin, end) rounds into out's columns [begin, end) of every
// row, as Tensor.to does (round to nearest even), so the result is that of a float32 out
// converted after the call.
class FloatOut {
 public:
  explicit FloatOut(at::Tensor out) : out_(std::move(out)) {
    if (out_.scalar_type() == at::kFloat) {
      floats_ = out_.data_ptr<float>();
    } else {
      buffer_.resize(out_.numel());
      floats_ = buffer_.data();
    }
  }
  float* floats() const { return floats_; }
  const at::Tensor& tensor() const { return out_; }
  void round(int64_t begin, int64_t end) const {
    if (out_.scalar_type() == at::kFloat) return;  // written in place
    const int64_t cols = out_.size(1);
    for (int64_t m = 0; m < out_.size(0); ++m)
      pagedserve::round_into(floats_ + m * cols + begin, out_, m * cols + begin, end - begin);
  }

 private:
  at::Tensor out_;
  std::vector<float> buffer_;
  float* floats_ = nullptr;
};

// Blocks a thread takes at a time (parallel_for's grain). A few rows against a weight under
// 1 MiB (every linear of a 135M model) go in one chunk per thread: the pool's default of
// four a thread cut such a weight into runs of ~30 KB, and each run's start stalls on
// memory (the default model's 120 linears a step: 1.86 vs 2.23 ms, and its decode 0.89x
// the time a token, same-process A/Bs on a Zen 5; the 1B's unchanged). Larger weights and
// batches keep the finer chunks, which even out the threads.
// Example: 60 blocks of 4.5 KB on 2 threads -> grain 30 (two chunks); 192 blocks of 16 KB
// -> grain 1 (eight chunks).
inline int64_t block_grain(int64_t blocks, int64_t block_bytes, int64_t rows) {
  constexpr int64_t kSmallWeightBytes = int64_t{1} << 20;
  const int64_t threads = std::max(1, at::get_num_threads());
  if (rows > 8 || blocks * block_bytes >= kSmallWeightBytes) return 1;
  return (blocks + threads - 1) / threads;
}

// out [M, N] = x [M, K] @ W.T for W in blocks (mins: int4 only, else empty); x float32,
// bfloat16 or float16, out in x's dtype (computed in float32, then rounded).
template <bool kInt8>
at::Tensor blocked_linear(const at::Tensor& x, const uint8_t* w, int64_t blocks, int64_t groups,
                          GroupLanes s, GroupLanes mn, bool six_bit = false) {
  const int64_t cols = groups * kGroup;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && pagedserve::float_dtype(x.scalar_type()),
              "x must be a contiguous float32, bfloat16 or float16 [M, K] tensor");
  TORCH_CHECK(x.size(1) == cols, "x has ", x.size(1), " columns, the weight ", cols);
  const int64_t rows = x.size(0), num_out = blocks * kLanes;
  const int bits = activation_bits();  // once per call: a switch mid-call does not split it
  std::vector<float> widened;
  const float* xf = pagedserve::float_values(x, widened);
  const FloatOut out(at::empty({rows, num_out}, x.options()));
  float* op = out.floats();
  // GGUF Q6_K / Q3_K (two scale segments) and Q5_K hold 6-bit weights.
  const int64_t bytes = group_stride(kInt8, six_bit);
  const int64_t grain = block_grain(blocks, groups * bytes, rows);
  // Block b's weights, scales, mins (int4) and outputs.
  auto block_w = [&](int64_t b) { return w + b * groups * bytes; };
  auto block_s = [&](int64_t b) { return s.block(b, groups); };
  auto block_m = [&](int64_t b) { return mn.block(b, groups); };
  if constexpr (kHasX8Kernel<kInt8>) {
    if (bits == 8) {
      // A prefill chunk's rows are rounded on both threads (16 rows a chunk at least).
      const Int8Activations a = quantize_activations_int8(
          xf, rows, cols, /*offset=*/kInt8,
          [](int64_t begin, int64_t end, const auto& fn) {
            pagedserve::parallel_for(begin, end, 16, fn);
          });
      const int64_t tile = row_tile(cols, 1);
      pagedserve::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
        for (int64_t t0 = 0; t0 < rows; t0 += tile)
          for (int64_t b = begin; b < end; ++b) {
            row_passes(t0, std::min(tile, rows - t0), [&](auto r, int64_t m0) {
              constexpr int R = decltype(r)::value;
              if (kInt8 && six_bit && s.segments == 2) {
                block_rows_x8<kInt8, R, true>(block_w(b), block_s(b), block_m(b), groups, a, cols,
                                              m0, op + b * kLanes, num_out);
              } else if (kInt8 && six_bit) {
                block_rows_x8<kInt8, R, true, 1>(block_w(b), block_s(b), block_m(b), groups, a,
                                                 cols, m0, op + b * kLanes, num_out);
              } else {
                block_rows_x8<kInt8, R>(block_w(b), block_s(b), block_m(b), groups, a, cols, m0,
                                        op + b * kLanes, num_out);
              }
            });
          }
        out.round(begin * kLanes, end * kLanes);
      });
      return out.tensor();
    }
  }
  const QuantizedActivations a = quantize_activations(xf, rows, cols,
                                                      /*pairs=*/false, /*transposed=*/false,
                                                      activation_levels(bits));
  const int64_t tile = row_tile(cols, 2);
  pagedserve::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < rows; t0 += tile)
      for (int64_t b = begin; b < end; ++b) {
        row_passes(t0, std::min(tile, rows - t0), [&](auto r, int64_t m0) {
          constexpr int R = decltype(r)::value;
          if (kInt8 && six_bit && s.segments == 2) {  // GGUF Q6_K, Q3_K: a scale per 16 columns
            block_rows<kInt8, R, true>(block_w(b), block_s(b), block_m(b), groups, a, cols, m0,
                                       op + b * kLanes, num_out);
          } else if (kInt8 && six_bit) {  // GGUF Q5_K: six bits, a scale and min per group
            block_rows<kInt8, R, true, 1>(block_w(b), block_s(b), block_m(b), groups, a, cols,
                                          m0, op + b * kLanes, num_out);
          } else {
            block_rows<kInt8, R>(block_w(b), block_s(b), block_m(b), groups, a, cols, m0,
                                 op + b * kLanes, num_out);
          }
        });
      }
    out.round(begin * kLanes, end * kLanes);
  });
  return out.tensor();
}

// Blocked scales/mins: contiguous float16 [blocks, groups, 16], or uint8 super-blocks
// [blocks, groups / 8, 160 or 288] (GroupLanes).
GroupLanes group_lanes(const at::Tensor& t, int64_t blocks, int64_t groups, const char* what) {
  TORCH_CHECK(t.defined() && t.is_contiguous() && t.dim() == 3 && t.size(0) == blocks,
              "blocked ", what, " must be a contiguous [N / 16, ...] tensor");
  if (t.scalar_type() == at::kByte) {
    const int64_t bytes = t.size(2);
    TORCH_CHECK(groups % 8 == 0 && t.size(1) == groups / 8 &&
                    (bytes == GroupLanes::kQ4kBytes || bytes == GroupLanes::kQ6kBytes),
                "blocked ", what, " in super-blocks must be uint8 [N / 16, K / 256, 160 or 288]");
    return {t.data_ptr<uint8_t>(), bytes, bytes == GroupLanes::kQ6kBytes ? 2 : 1};
  }
  TORCH_CHECK(t.scalar_type() == at::kHalf && t.size(1) == groups && t.size(2) == kLanes,
              "blocked ", what, " must be float16 [N / 16, K / 32, 16]");
  return {reinterpret_cast<const uint8_t*>(halves(t)), 0, 1};
}

void check_blocked(const at::Tensor& packed, at::ScalarType dtype, int64_t bytes,
                   const char* what) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == dtype && packed.is_contiguous() &&
                  packed.size(2) == bytes,
              "blocked ", what, " weights must be a contiguous [N / 16, K / 32, ", bytes, "] tensor");
}

}  // namespace

bool is_blocked(const at::Tensor& packed) { return packed.dim() == 3; }

// Whether blocked int8 weights are held in six bits (384 bytes a group: GGUF Q6_K, Q3_K, Q5_K).
bool is_six_bit(const at::Tensor& packed) {
  return packed.dim() == 3 && packed.size(2) == kQ6kGroupBytes;
}

// Whether an int8 weight has mins (an undefined or empty tensor: none).
bool has_mins(const at::Tensor& mins) { return mins.defined() && mins.numel() > 0; }

namespace {
// An int8 weight's mins lanes (GGUF Q5_K), or none.
GroupLanes int8_mins(const at::Tensor& mins, int64_t blocks, int64_t groups) {
  return has_mins(mins) ? group_lanes(mins, blocks, groups, "int8 mins") : GroupLanes{};
}
}  // namespace

void check_blocked_weight(const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& mins, int64_t bits) {
  if (bits == 4) {
    check_blocked(packed, at::kByte, kBytesPerGroup<false>, "int4 (uint8)");
  } else {  // 512 bytes per group, or six bits' 384 (GGUF Q6_K, Q3_K, Q5_K)
    const bool six_bit = is_six_bit(packed);
    check_blocked(packed, at::kChar, group_stride(true, six_bit),
                  six_bit ? "six-bit (int8)" : "int8 (int8)");
  }
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  const GroupLanes s = group_lanes(scales, blocks, groups, "scales");
  TORCH_CHECK(bits == 4 || s.segments == 1 || is_six_bit(packed),
              "16-column scales (288-byte super-blocks) go with six-bit weights (384 bytes a group)");
  if (bits == 4) {
    TORCH_CHECK(s.segments == 1 && group_lanes(mins, blocks, groups, "int4 mins").segments == 1,
                "int4 scales and mins cover whole groups (160-byte super-blocks)");
  } else if (has_mins(mins)) {  // int8 with mins (GGUF Q5_K): whole-group scales and mins
    TORCH_CHECK(s.segments == 1 && group_lanes(mins, blocks, groups, "int8 mins").segments == 1,
                "int8 mins need whole-group scales and mins (160-byte super-blocks)");
  }
}

at::Tensor blocked_int4_linear(at::Tensor x, at::Tensor packed, at::Tensor scales,
                               at::Tensor mins) {
  check_blocked_weight(packed, scales, mins, 4);
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  return blocked_linear<false>(x, packed.data_ptr<uint8_t>(), blocks, groups,
                               group_lanes(scales, blocks, groups, "int4 scales"),
                               group_lanes(mins, blocks, groups, "int4 mins"));
}

at::Tensor blocked_int8_linear(at::Tensor x, at::Tensor packed, at::Tensor scales,
                               at::Tensor mins) {
  check_blocked_weight(packed, scales, mins, 8);
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  return blocked_linear<true>(x, reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>()),
                              blocks, groups, group_lanes(scales, blocks, groups, "int8 scales"),
                              int8_mins(mins, blocks, groups), is_six_bit(packed));
}

// ---- The tiled path's decoders: block `block`'s 16 rows as float32 [16, K] ----

// One group in the int8 layout (512 bytes: [pair p][lane j][2], a 16 x 16 matrix of 16-bit
// words M[p][j], row j's columns 2p, 2p + 1) as 16 rows of 32 floats: row j's weights are
// column j of M (a transpose), then dst[j cols + k] = scale[k / 16][j] q + lowest[j]
// (lowest: int4's mins, or none). int4 and Q6_K groups are first put in this layout.
class GroupRows {
 public:
  GroupRows() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // Register i holds pairs 2i and 2i + 1 (M[2i][0..15], M[2i + 1][0..15]). One vpermw
    // interleaves them, dword j = (M[2i][j], M[2i + 1][j]): row j's columns 4i .. 4i + 3,
    // and qword k = rows 2k, 2k + 1. An 8 x 8 transpose of qwords (3 stages of vpermt2q:
    // at stage s, registers a and a + 2^s swap the halves whose qword index has bit s
    // set) leaves in register k qword i = (row 2k, row 2k + 1) columns 4i .. 4i + 3, and
    // one vpermd makes it row 2k's 32 bytes, then row 2k + 1's.
    alignas(64) int16_t interleave[32];
    for (int j = 0; j < 16; ++j) interleave[2 * j] = j, interleave[2 * j + 1] = 16 + j;
    pairs_to_rows_ = _mm512_load_si512(interleave);
    for (int st = 0; st < 3; ++st) {
      const int stride = 1 << st;
      alignas(64) int64_t low[8], high[8];
      for (int k = 0; k < 8; ++k) {
        const bool upper = k & stride;
        low[k] = upper ? 8 + k - stride : k;   // from register a, or b's lower qword
        high[k] = upper ? 8 + k : k + stride;  // a's upper qword, or from register b
      }
      stage_low_[st] = _mm512_load_si512(low);
      stage_high_[st] = _mm512_load_si512(high);
    }
    rows_apart_ = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
  }

  void write(const int8_t* bytes, const float* scale0, const float* scale1,
             const float* lowest, float* dst, int64_t cols) const {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512i r[8];
    for (int i = 0; i < 8; ++i)
      r[i] = _mm512_permutexvar_epi16(pairs_to_rows_, _mm512_loadu_si512(bytes + 64 * i));
    for (int st = 0; st < 3; ++st)
      for (int a = 0; a < 8; ++a)
        if (!(a & (1 << st))) {
          const int b = a + (1 << st);
          const __m512i low = _mm512_permutex2var_epi64(r[a], stage_low_[st], r[b]);
          r[b] = _mm512_permutex2var_epi64(r[a], stage_high_[st], r[b]);
          r[a] = low;
        }
    for (int k = 0; k < 8; ++k) {
      const __m512i two_rows = _mm512_permutexvar_epi32(rows_apart_, r[k]);
      // Quarter c: 16 weights of row 2k + c / 2 (the index of an extract is an immediate).
      const __m128i quarters[4] = {
          _mm512_extracti32x4_epi32(two_rows, 0), _mm512_extracti32x4_epi32(two_rows, 1),
          _mm512_extracti32x4_epi32(two_rows, 2), _mm512_extracti32x4_epi32(two_rows, 3)};
      for (int c = 0; c < 4; ++c) {
        const int j = 2 * k + c / 2;
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(quarters[c]));
        const __m512 scale = _mm512_set1_ps((c % 2 ? scale1 : scale0)[j]);
        _mm512_storeu_ps(dst + j * cols + 16 * (c % 2),
                         lowest ? _mm512_fmadd_ps(q, scale, _mm512_set1_ps(lowest[j]))
                                : _mm512_mul_ps(q, scale));
      }
    }
#else
    for (int j = 0; j < kLanes; ++j)
      for (int k = 0; k < kGroup; ++k) {  // column k = pair k / 2, its value k % 2
        const float q = static_cast<float>(bytes[(k / 2) * 32 + 2 * j + k % 2]);
        const float scale = (k < 16 ? scale0 : scale1)[j];
        dst[j * cols + k] = lowest ? std::fma(q, scale, lowest[j]) : q * scale;
      }
#endif
  }

 private:
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512i pairs_to_rows_, stage_low_[3], stage_high_[3], rows_apart_;
#endif
};

// int4 group (256 bytes) -> the int8 layout: quad t's low nibbles are its first pair of
// each lane (bytes 2j, 2j + 1 = columns 4t, 4t + 1), the high nibbles its second.
inline void int4_group_as_int8(const uint8_t* src, int8_t* dst) {
  for (int t = 0; t < 8; ++t) {
#if defined(__AVX2__)
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * t));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 64 * t), _mm256_and_si256(v, low4));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 64 * t + 32),
                        _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
#else
    for (int b = 0; b < 32; ++b) {
      dst[64 * t + b] = static_cast<int8_t>(src[32 * t + b] & 15);
      dst[64 * t + 32 + b] = static_cast<int8_t>(src[32 * t + b] >> 4);
    }
#endif
  }
}

void decode_blocked_int4(const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t block, float* dst) {
  const int64_t groups = packed.size(1), cols = groups * kGroup;
  const uint8_t* bytes = packed.data_ptr<uint8_t>() + block * groups * kBytesPerGroup<false>;
  const int64_t blocks = packed.size(0);
  const GroupLanes s = group_lanes(scales, blocks, groups, "int4 scales").block(block, groups);
  const GroupLanes mn = group_lanes(mins, blocks, groups, "int4 mins").block(block, groups);
  const GroupRows rows;
  alignas(64) int8_t group[512];
  for (int64_t g = 0; g < groups; ++g) {
    float scale[kLanes], lowest[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      scale[j] = s.lane(g, j);
      lowest[j] = mn.lane(g, j);
    }
    int4_group_as_int8(bytes + g * kBytesPerGroup<false>, group);
    rows.write(group, scale, scale, lowest, dst + g * kGroup, cols);
  }
}

// Blocked int8 (W[16 b + j, 32 g + k] = scales[b, g, j] q (+ mins[b, g, j]: GGUF Q5_K)), or
// Q6_K's six bits decoded to it with a scale per 16 columns.
void decode_blocked_int8(const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t block, float* dst) {
  const int64_t groups = packed.size(1), cols = groups * kGroup;
  const GroupLanes s =
      group_lanes(scales, packed.size(0), groups, "int8 scales").block(block, groups);
  const GroupLanes mn = int8_mins(mins, packed.size(0), groups).block(block, groups);
  const bool q6k = is_six_bit(packed);
  const uint8_t* stored = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>()) +
                          block * groups * group_stride(true, q6k);
  const GroupRows rows;
  alignas(64) uint8_t q6k_group[512];
  for (int64_t g = 0; g < groups; ++g) {
    float scale0[kLanes], scale1[kLanes], lowest[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      scale0[j] = s.lane(g, j, 0);
      scale1[j] = s.lane(g, j, s.segments - 1);
      if (mn.p != nullptr) lowest[j] = mn.lane(g, j);
    }
    const uint8_t* bytes = q6k ? group_bytes<true, true>(stored, g, q6k_group)
                               : group_bytes<true, false>(stored, g, q6k_group);
    rows.write(reinterpret_cast<const int8_t*>(bytes), scale0, scale1,
               mn.p != nullptr ? lowest : nullptr, dst + g * kGroup, cols);
  }
}
