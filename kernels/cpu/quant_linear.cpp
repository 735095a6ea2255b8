// Weight-only quantized linears for the CPU: out[M, N] = x[M, K] @ W[N, K]^T, where W is
// stored in 4 or 8 bits in groups of 32 input columns with float16 scales (and mins), as GGUF's
// Q4_0 / Q4_1 / Q8_0 are, so those checkpoints run exactly in their own precision:
//
//   int4:  W[n, k] = mins[n, g] + scales[n, g] * q[n, k]    q in [0, 15], g = k / 32
//          (Q4_1: mins = m, scales = d;  Q4_0: mins = -8 d, scales = d)
//   int8:  W[n, k] = scales[n, g] * q[n, k]                 q in [-128, 127]  (Q8_0)
//
// int4 packing, per row and group of 32 (16 bytes): byte j holds q[j] in its low nibble
// and q[j + 16] in its high nibble. Example, q = [0, 1, ..., 31] % 16 per group:
// byte 0 = 0x00 | (0x0 << 4) ... byte 1 = 0x1 | (0x1 << 4) = 0x11.
//
// A decode step multiplies few rows (M small) by every weight once, so the work per
// weight must be a handful of instructions. x is quantized too, per row and group of
// 32, to int16 with a float32 scale:
//
//   dx[m, g] = max_k |x[m, k]| / 32767,  xq[m, k] = round(x[m, k] / dx[m, g])  (half to even)
//
// and each group's dot product is integer arithmetic (AVX2: 32 multiply-adds in two
// _mm256_madd_epi16), scaled once per group:
//
//   out[m, n] = sum_g  scales[n, g] dx[m, g] (q[n, g, :] . xq[m, g, :])
//                    + mins[n, g] dx[m, g] sum(xq[m, g, :])          (int4 only)
//
// which is exactly x' @ W^T for the rounded activations x' = dx * xq: the error is
// sum_k W[n, k] (x - x')[k], at most sum_k |W[n, k]| dx / 2 (the min term must use
// the rounded sum too: with the exact one, the error would scale with |scales * q|,
// up to twice |W|, instead of |W|). With 16 bits that is a relative error of at most
// 1.5e-5 of a group's largest |x|: below float32 noise for a model. (llama.cpp rounds
// x to 8 bits, which is faster still but visibly changes greedy outputs: SmolLM2's
// Q4_1 answer to "What is the capital of France?" flips from "The capital ..." to
// "L'Étoile ...", a near-tie that 8-bit rounding tips over.)
//
// Its torch reference is kernels.reference.quant_linear_ref. Each thread takes a range
// of output rows n. By batch size (see the dispatch comment above quant_linear):
//   1 row (int4; a one-client decode step)  dot_rows_int4: two groups per load, eight
//                                           groups scaled per vector instruction
//   8-23 rows, per full block of 8 rows     dot_8rows: one output row at a time
//   24+ rows, per full block of 8 rows      dot_tile: tiles of 8 rows x 8 outputs
//   the rows left over (and small batches)  dot_rows: four rows per decoded group

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "spin_pool.h"

#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;
// Batches of at least this many rows take dot_tile for their full blocks of 8 rows, smaller
// ones dot_8rows (see the dispatch comment above quant_linear).
constexpr int64_t kTileMinRows = 24;

// Scales and mins are float16 (GGUF's own precision for Q4_0 / Q4_1 / Q8_0).
inline float half_to_float(uint16_t bits) {
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

#if defined(__AVX2__) && defined(__F16C__)
inline __m256 load_halves(const uint16_t* p) {  // 8 float16 -> 8 float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
constexpr int64_t kRowBlock = 4;  // rows of x sharing one decode of a weight group

// Where step i of a group's 16 steps in a tile of 8 rows x 8 outputs (dot_tile) takes
// its pair of columns (j, j + 16): the weight pairs come out of AVX2's 16-bit unpacks,
// which work within each 128-bit half, in the order
//   i = 0..15  ->  j = 0 1 2 3 8 9 10 11 4 5 6 7 12 13 14 15
// so column pair j sits at step i = j with bits 2 and 3 swapped.
// Example: j = 4 (0b0100) -> i = 8 (0b1000).
inline int64_t pair_step(int64_t j) { return (j & 3) | ((j & 4) << 1) | ((j & 8) >> 1); }

// x [M, K] float32 -> xq int16, dx [M, G], sums [M, G] = dx * sum(xq) per group.
// `values` holds `stride` int16 per row: K in natural order (dot_rows), or (`pairs`, the
// one-row int4 kernel) each pair of groups (g, g + 1) interleaved in runs of 8, the order
// in which one 32-byte load of their packed weights unpacks (see dot_rows_int4):
//   [g 0-7, g+1 0-7, g 8-15, g+1 8-15, g 16-23, g+1 16-23, g 24-31, g+1 24-31]
// Example, K = 96 (3 groups): stride 128; the last pair is group 2 with a zero group 3.
// The first `blocked_rows` rows (a multiple of 8) are also written to `blocked`, for
// dot_tile: block b (rows 8b..8b+7) at 8b * K, then per group 16 steps of 8 int32 pairs,
// step i = pair_step(j) holding (x[r, j], x[r, j + 16]) of the group for r = 0..7:
//   blocked[8b * K + 256 g + 16 pair_step(j) + 2 r + (k >= 16)],   j = k % 16
// Example: row 8b + 3, k = 32 g + 20 -> j = 4, step 8 -> 8b K + 256 g + 128 + 7.
// Below kTileMinRows (dot_8rows) there is no `blocked` copy; scales_t / sums_t hold the
// same values as scales / sums as [G, M] (group-major) instead, so that a block's 8 rows
// read their scales of one group in one load.
struct QuantizedActivations {
  std::vector<int16_t> values, blocked;
  std::vector<float> scales, sums, scales_t, sums_t;
  int64_t stride = 0;
};

QuantizedActivations quantize_activations(const float* x, int64_t rows, int64_t cols,
                                          bool pairs, int64_t blocked_rows) {
  const int64_t groups = cols / kGroup;
  QuantizedActivations qa;
  qa.stride = pairs ? (groups + 1) / 2 * 2 * kGroup : cols;
  qa.values.assign(rows * qa.stride, 0);
  const bool transposed = blocked_rows > 0 && blocked_rows < kTileMinRows;  // dot_8rows
  qa.blocked.resize(transposed ? 0 : blocked_rows * cols);
  qa.scales.resize(rows * groups);
  qa.sums.resize(rows * groups);
  qa.scales_t.resize(transposed ? rows * groups : 0);
  qa.sums_t.resize(transposed ? rows * groups : 0);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + m * cols + g * kGroup;
      float amax = 0.f;
      for (int64_t k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(xg[k]));
      const float scale = amax / 32767.f;
      const float inverse = scale > 0.f ? 1.f / scale : 0.f;
      int16_t* row = qa.values.data() + m * qa.stride;
      int16_t* block = m < blocked_rows && !transposed ? qa.blocked.data() + m / 8 * 8 * cols
                                                       : nullptr;
      int32_t sum = 0;
      for (int64_t k = 0; k < kGroup; ++k) {
        const int16_t q = static_cast<int16_t>(std::nearbyint(xg[k] * inverse));
        // pairs: run k / 8 of group g sits at run 2 (k / 8) + g % 2 of the pair's 64.
        row[pairs ? (g / 2) * 2 * kGroup + (2 * (k / 8) + g % 2) * 8 + k % 8 : g * kGroup + k] = q;
        if (block) block[g * 8 * kGroup + pair_step(k % 16) * 16 + 2 * (m % 8) + k / 16] = q;
        sum += q;
      }
      qa.scales[m * groups + g] = scale;
      qa.sums[m * groups + g] = scale * static_cast<float>(sum);
      if (transposed) {
        qa.scales_t[g * rows + m] = qa.scales[m * groups + g];
        qa.sums_t[g * rows + m] = qa.sums[m * groups + g];
      }
    }
  return qa;
}

#if defined(__AVX2__) && defined(__F16C__)
// One group's 32 weights as two vectors of 16 int16: q[0..15] and q[16..31].
inline void load_group(const uint8_t* w, bool int4, __m256i out[2]) {
  if (int4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i mask = _mm_set1_epi8(0x0F);
    out[0] = _mm256_cvtepu8_epi16(_mm_and_si128(packed, mask));
    out[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), mask));
  } else {
    out[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    out[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// int4, out[m, n] for R rows m0..m0+R-1 and one output row n, activations in the pairs
// layout. A pair of groups is one 32-byte load: its low nibbles are q[0..15] of both
// groups (lane 0: group g, lane 1: group g+1), its high nibbles q[16..31]; widening
// bytes to int16 in-lane (unpacklo/hi against zero) gives runs of 8 in the order
//   [g 0-7 | g+1 0-7], [g 8-15 | g+1 8-15], [g 16-23 | g+1 16-23], [g 24-31 | g+1 24-31]
// which is how quantize_activations laid x out. Four madd + add leave each lane with 4
// partial sums of its group. Eight groups (four pairs) are reduced together: three
// hadd give their totals in the order [0 2 4 6 | 1 3 5 7], turned to float and scaled by
// scales[n, g] * dx[m, g] permuted the same way: one multiply per 8 groups where the
// per-group loop (dot_rows) broadcast a scale per group. The Q4_1 min term is one fma
// per 8 groups. Leftover pairs are reduced alone; an odd last group is a pair whose
// second group has zero activations (its weights are not read).
template <int R>
inline void dot_rows_int4(const uint8_t* wrow, const uint16_t* srow, const uint16_t* mrow,
                          int64_t groups, const QuantizedActivations& qa, int64_t m0, float* out,
                          int64_t out_stride) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  // The 4 int32 partial sums per lane of pair p (groups 2p, 2p + 1) for row r.
  auto pair_sums = [&](int64_t p, bool single, __m256i sums[R]) {
    const uint8_t* wp = wrow + p * kGroup;  // 16 bytes per group
    const __m256i packed =
        single ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)))
               : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
    const __m256i lo = _mm256_and_si256(packed, low_nibbles);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
    const __m256i w0 = _mm256_unpacklo_epi8(lo, zero), w1 = _mm256_unpackhi_epi8(lo, zero);
    const __m256i w2 = _mm256_unpacklo_epi8(hi, zero), w3 = _mm256_unpackhi_epi8(hi, zero);
    for (int r = 0; r < R; ++r) {
      const __m256i* x = reinterpret_cast<const __m256i*>(
          qa.values.data() + (m0 + r) * qa.stride + p * 2 * kGroup);
      sums[r] = _mm256_add_epi32(
          _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(x)),
                           _mm256_madd_epi16(w1, _mm256_loadu_si256(x + 1))),
          _mm256_add_epi32(_mm256_madd_epi16(w2, _mm256_loadu_si256(x + 2)),
                           _mm256_madd_epi16(w3, _mm256_loadu_si256(x + 3))));
    }
  };
  __m256 acc[R], acc_min[R];
  float tail[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    acc_min[r] = _mm256_setzero_ps();
    tail[r] = 0.f;
  }
  __m256i s0[R], s1[R], s2[R], s3[R];
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    pair_sums(g / 2, false, s0);
    pair_sums(g / 2 + 1, false, s1);
    pair_sums(g / 2 + 2, false, s2);
    pair_sums(g / 2 + 3, false, s3);
    const __m256 wscale = load_halves(srow + g);
    const __m256 wmin = load_halves(mrow + g);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * groups + g;
      const __m256i totals = _mm256_hadd_epi32(_mm256_hadd_epi32(s0[r], s1[r]),
                                               _mm256_hadd_epi32(s2[r], s3[r]));
      const __m256 scale = _mm256_permutevar8x32_ps(
          _mm256_mul_ps(wscale, _mm256_loadu_ps(qa.scales.data() + at)), order);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals), scale, acc[r]);
      acc_min[r] = _mm256_fmadd_ps(wmin, _mm256_loadu_ps(qa.sums.data() + at), acc_min[r]);
    }
  }
  for (; g < groups; g += 2) {
    const bool single = g + 1 == groups;
    pair_sums(g / 2, single, s0);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * groups + g;
      const __m256i h = _mm256_hadd_epi32(s0[r], s0[r]);
      const __m256i totals = _mm256_hadd_epi32(h, h);  // lane 0: group g, lane 1: g + 1
      tail[r] += static_cast<float>(_mm256_extract_epi32(totals, 0)) * half_to_float(srow[g]) *
                     qa.scales[at] +
                 half_to_float(mrow[g]) * qa.sums[at];
      if (!single)
        tail[r] += static_cast<float>(_mm256_extract_epi32(totals, 4)) *
                       half_to_float(srow[g + 1]) * qa.scales[at + 1] +
                   half_to_float(mrow[g + 1]) * qa.sums[at + 1];
    }
  }
  for (int r = 0; r < R; ++r)
    out[(m0 + r) * out_stride] = hsum(acc[r]) + hsum(acc_min[r]) + tail[r];
}

// out[m, n] for R rows m0..m0+R-1 and one output row n.
template <bool kInt4, int R>
inline void dot_rows(const uint8_t* wrow, const uint16_t* srow, const uint16_t* mrow, int64_t groups,
                     const QuantizedActivations& qa, int64_t m0, float* out,
                     int64_t out_stride) {
  __m256 acc[R];
  float acc_min[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    acc_min[r] = 0.f;
  }
  __m256i w[2];
  for (int64_t g = 0; g < groups; ++g) {
    load_group(wrow + g * (kInt4 ? kGroup / 2 : kGroup), kInt4, w);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int16_t* xq = qa.values.data() + m * qa.stride + g * kGroup;
      // 16 x (int16 * int16 + int16 * int16) -> 8 int32, twice; |sum| < 2^23, exact.
      const __m256i dot = _mm256_add_epi32(
          _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq))),
          _mm256_madd_epi16(w[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16))));
      const float scale = half_to_float(srow[g]) * qa.scales[m * groups + g];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale), acc[r]);
      if (kInt4) acc_min[r] += half_to_float(mrow[g]) * qa.sums[m * groups + g];
    }
  }
  for (int r = 0; r < R; ++r) out[(m0 + r) * out_stride] = hsum(acc[r]) + acc_min[r];
}
// The 8 x 8 int32 transpose: r[o][i] -> r[i][o].
inline void transpose8x8(__m256i r[8]) {
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
  r[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
  r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
  r[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
  r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
  r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// One group of 8 output rows, unpacked for dot_tile: 16 steps of 8 int32 weight pairs
// (lane o: q[n + o, j] | q[n + o, j + 16] << 16, in the step order of pair_step), and the
// 8 rows' scales and mins as float32.
template <bool kInt4>
inline void unpack_tile_group(const uint8_t* weight, int64_t row_bytes, const uint16_t* scales,
                              const uint16_t* mins, int64_t groups, int64_t n, int64_t g,
                              int32_t* pairs, float* wscale, float* wmin) {
  __m256i lo[8], hi[8], q[2];
  for (int o = 0; o < 8; ++o) {
    load_group(weight + (n + o) * row_bytes + g * (kInt4 ? kGroup / 2 : kGroup), kInt4, q);
    lo[o] = _mm256_unpacklo_epi16(q[0], q[1]);  // steps 0-7 (j = 0-3, 8-11)
    hi[o] = _mm256_unpackhi_epi16(q[0], q[1]);  // steps 8-15 (j = 4-7, 12-15)
  }
  transpose8x8(lo);
  transpose8x8(hi);
  __m256i* dst = reinterpret_cast<__m256i*>(pairs);
  for (int i = 0; i < 8; ++i) {
    _mm256_store_si256(dst + i, lo[i]);
    _mm256_store_si256(dst + 8 + i, hi[i]);
  }
  for (int o = 0; o < 8; ++o) {
    wscale[o] = half_to_float(scales[(n + o) * groups + g]);
    if (kInt4) wmin[o] = half_to_float(mins[(n + o) * groups + g]);
  }
}

// The integer dots of one group for 8 rows x 8 outputs: d[r] lane o = q[n + o, g, :] .
// xq[m0 + r, g, :]. Each of the 16 steps loads the 8 outputs' weight pairs once and
// multiplies them by each row's activation pair, broadcast: 8 madd + 8 add. Written in
// assembly because GCC 12 spills one of the 8 accumulators to the stack in this loop
// (16 registers: 8 sums, the weights, and the broadcasts it loads all ahead), which made
// it ~1.5x slower (stand-alone, one thread: 47 against ~30 G multiply-adds/s).
inline void tile_group_dots(const int32_t* w, const int16_t* x, __m256i d[8]) {
  __m256i d0 = _mm256_setzero_si256(), d1 = d0, d2 = d0, d3 = d0, d4 = d0, d5 = d0, d6 = d0,
          d7 = d0;
  int64_t steps = 16;
  asm volatile(
      "1:\n\t"
      "vmovdqu (%[w]), %%ymm15\n\t"
      "vpbroadcastd (%[x]), %%ymm14\n\t"
      "vpmaddwd %%ymm14, %%ymm15, %%ymm14\n\t"
      "vpaddd %%ymm14, %[d0], %[d0]\n\t"
      "vpbroadcastd 4(%[x]), %%ymm13\n\t"
      "vpmaddwd %%ymm13, %%ymm15, %%ymm13\n\t"
      "vpaddd %%ymm13, %[d1], %[d1]\n\t"
      "vpbroadcastd 8(%[x]), %%ymm12\n\t"
      "vpmaddwd %%ymm12, %%ymm15, %%ymm12\n\t"
      "vpaddd %%ymm12, %[d2], %[d2]\n\t"
      "vpbroadcastd 12(%[x]), %%ymm11\n\t"
      "vpmaddwd %%ymm11, %%ymm15, %%ymm11\n\t"
      "vpaddd %%ymm11, %[d3], %[d3]\n\t"
      "vpbroadcastd 16(%[x]), %%ymm14\n\t"
      "vpmaddwd %%ymm14, %%ymm15, %%ymm14\n\t"
      "vpaddd %%ymm14, %[d4], %[d4]\n\t"
      "vpbroadcastd 20(%[x]), %%ymm13\n\t"
      "vpmaddwd %%ymm13, %%ymm15, %%ymm13\n\t"
      "vpaddd %%ymm13, %[d5], %[d5]\n\t"
      "vpbroadcastd 24(%[x]), %%ymm12\n\t"
      "vpmaddwd %%ymm12, %%ymm15, %%ymm12\n\t"
      "vpaddd %%ymm12, %[d6], %[d6]\n\t"
      "vpbroadcastd 28(%[x]), %%ymm11\n\t"
      "vpmaddwd %%ymm11, %%ymm15, %%ymm11\n\t"
      "vpaddd %%ymm11, %[d7], %[d7]\n\t"
      "add $32, %[w]\n\t"
      "add $32, %[x]\n\t"
      "dec %[steps]\n\t"
      "jnz 1b\n\t"
      : [d0] "+x"(d0), [d1] "+x"(d1), [d2] "+x"(d2), [d3] "+x"(d3), [d4] "+x"(d4),
        [d5] "+x"(d5), [d6] "+x"(d6), [d7] "+x"(d7), [w] "+r"(w), [x] "+r"(x),
        [steps] "+r"(steps)
      :
      : "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc");
  d[0] = d0, d[1] = d1, d[2] = d2, d[3] = d3, d[4] = d4, d[5] = d5, d[6] = d6, d[7] = d7;
}

// out[m, n + o] for every full 8-row block (rows < blocked_rows) and the 8 output rows
// n..n+7. Each group of the 8 rows' weights is unpacked once (unpack_tile_group) and
// serves every block; lane o of every vector is output n + o, and per group and row r
//   acc[r]     += float(d[r]) * (scales[n + o, g] * dx[m0 + r, g])
//   acc_min[r] += mins[n + o, g] * sums[m0 + r, g]                     (int4 only)
// the same products in the same order as the per-row kernels' (so the same bits).
// `acc` holds 2 x 8 vectors per block (acc, acc_min), reused across calls.
template <bool kInt4>
inline void dot_tile(const uint8_t* weight, int64_t row_bytes, const uint16_t* scales,
                     const uint16_t* mins, int64_t groups, const QuantizedActivations& qa,
                     int64_t cols, int64_t blocked_rows, int64_t n, float* out,
                     int64_t out_stride, std::vector<__m256>& acc) {
  const int64_t num_blocks = blocked_rows / 8;
  acc.assign(num_blocks * 16, _mm256_setzero_ps());
  alignas(32) int32_t pairs[128];
  alignas(32) float wscale[8], wmin[8] = {};
  __m256i d[8];
  for (int64_t g = 0; g < groups; ++g) {
    unpack_tile_group<kInt4>(weight, row_bytes, scales, mins, groups, n, g, pairs, wscale,
                             wmin);
    const __m256 ws = _mm256_load_ps(wscale), wm = _mm256_load_ps(wmin);
    for (int64_t b = 0; b < num_blocks; ++b) {
      tile_group_dots(pairs, qa.blocked.data() + b * 8 * cols + g * 8 * kGroup, d);
      __m256* block_acc = acc.data() + b * 16;
      for (int r = 0; r < 8; ++r) {
        const int64_t at = (b * 8 + r) * groups + g;
        block_acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r]),
                                       _mm256_mul_ps(ws, _mm256_set1_ps(qa.scales[at])),
                                       block_acc[r]);
        if (kInt4)
          block_acc[8 + r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(qa.sums[at]), block_acc[8 + r]);
      }
    }
  }
  for (int64_t b = 0; b < num_blocks; ++b)
    for (int r = 0; r < 8; ++r)
      _mm256_storeu_ps(out + (b * 8 + r) * out_stride + n,
                       _mm256_add_ps(acc[b * 16 + r], acc[b * 16 + 8 + r]));
}
// out[m, n] for the 8 rows m0..m0+7 (a full block of a batch below kTileMinRows rows) and
// one output row n. dot_rows scales each row's
// 8 lanes of partial sums per group (a scalar scale, a broadcast and an FMA per row and
// group); here the 8 rows' integer dots of a group are first reduced across lanes and
// gathered into one vector, lane r = row m0 + r, so a group costs one multiply and one
// FMA for all 8 rows (and one more FMA for the Q4_1 min term). The reduction:
//   h01 = hadd(d0, d1) ... h67;  h0123 = hadd(h01, h23), h4567 = hadd(h45, h67)
//   h0123 = [d0 d1 d2 d3 (lanes 0-3 of each) | d0 d1 d2 d3 (lanes 4-7)]
//   dots  = [low halves of h0123, h4567] + [high halves of h0123, h4567] = [d0 .. d7]
// Integer sums are exact, so only the float rounding order differs from dot_rows.
template <bool kInt4>
inline void dot_8rows(const uint8_t* wrow, const uint16_t* srow, const uint16_t* mrow,
                      int64_t groups, const QuantizedActivations& qa, int64_t rows, int64_t m0,
                      float* out, int64_t out_stride) {
  __m256 acc = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
  __m256i w[2], d[8];
  for (int64_t g = 0; g < groups; ++g) {
    load_group(wrow + g * (kInt4 ? kGroup / 2 : kGroup), kInt4, w);
    for (int r = 0; r < 8; ++r) {
      const int16_t* xq = qa.values.data() + (m0 + r) * qa.stride + g * kGroup;
      d[r] = _mm256_add_epi32(
          _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq))),
          _mm256_madd_epi16(w[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16))));
    }
    const __m256i h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]),
                                            _mm256_hadd_epi32(d[2], d[3]));
    const __m256i h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]),
                                            _mm256_hadd_epi32(d[6], d[7]));
    const __m256i dots = _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                                          _mm256_permute2x128_si256(h0123, h4567, 0x31));
    const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(half_to_float(srow[g])),
                                       _mm256_loadu_ps(qa.scales_t.data() + g * rows + m0));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, acc);
    if (kInt4)
      acc_min = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(mrow[g])),
                                _mm256_loadu_ps(qa.sums_t.data() + g * rows + m0), acc_min);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(acc, acc_min));
  for (int r = 0; r < 8; ++r) out[(m0 + r) * out_stride] = lanes[r];
}
#else
// Portable version of the same arithmetic: integer dot per group, scaled in float.
template <bool kInt4, int R>
inline void dot_rows(const uint8_t* wrow, const uint16_t* srow, const uint16_t* mrow, int64_t groups,
                     const QuantizedActivations& qa, int64_t m0, float* out,
                     int64_t out_stride) {
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    float acc = 0.f, acc_min = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const int16_t* xq = qa.values.data() + m * qa.stride + g * kGroup;
      int32_t dot = 0;
      for (int64_t k = 0; k < kGroup; ++k) {
        int32_t q;
        if (kInt4) {
          const uint8_t byte = wrow[g * (kGroup / 2) + (k % 16)];
          q = k < 16 ? (byte & 0x0F) : (byte >> 4);
        } else {
          q = static_cast<int8_t>(wrow[g * kGroup + k]);
        }
        dot += q * xq[k];
      }
      acc += static_cast<float>(dot) * (half_to_float(srow[g]) * qa.scales[m * groups + g]);
      if (kInt4) acc_min += half_to_float(mrow[g]) * qa.sums[m * groups + g];
    }
    out[m * out_stride] = acc + acc_min;
  }
}
#endif

const uint16_t* halves(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

void check_common(const at::Tensor& x, const at::Tensor& scales, int64_t num_out,
                  int64_t in_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == in_features, "x has ", x.size(1), " columns, the weight ",
              in_features);
  TORCH_CHECK(in_features % kGroup == 0, "in_features must be a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == num_out &&
                  scales.size(1) == in_features / kGroup,
              "scales must be a contiguous float16 [N, K / 32] tensor");
}

// int4 batches of up to kPairsMaxRows rows take dot_rows_int4 (AVX2). Larger ones and int8
// take, for each full block of 8 rows (AVX2), dot_8rows below kTileMinRows rows (linear_chain,
// int4, ABBA x3 on a noisy VM: 8 rows 36.0 vs 39.5 ms, 32 rows 147 vs 162 ms against dot_rows
// alone) and dot_tile from there on, and the per-group loop (dot_rows, each weight group
// decoded once for kRowBlock rows) for the rest. dot_tile against dot_8rows (SmolLM2's five
// linear shapes, both builds in one process alternating, best of 21, 2 threads): int4 24 /
// 32 / 64 rows 0.68 / 0.77 / 0.65 of the time, int8 0.96 / 0.85 / 0.82; at 16 rows int4
// 0.81-1.06 and int8 1.06-1.09 (its weight unpacking and transposes are shared by only two
// blocks), at 8 rows it does not pay: hence kTileMinRows = 24.
// Why dot_rows_int4 stops at one row: it keeps 4 pairs' sums per row in registers, and
// with more than 2 rows they spill (measured, one thread, SmolLM2's linears: 1 row 13.8 vs
// 16.0 ms; 2 rows 20.1 vs 20.1; 4 rows 43.8 vs 31.8 ms).
constexpr int64_t kPairsMaxRows = 1;
constexpr int64_t kTileOut = 16;  // output rows per pass over one 8-row block (dot_8rows)

template <bool kInt4>
at::Tensor quant_linear(const at::Tensor& x, const uint8_t* weight, int64_t row_bytes,
                        const uint16_t* scales, const uint16_t* mins, int64_t num_out) {
  const int64_t rows = x.size(0), cols = x.size(1), groups = cols / kGroup;
#if defined(__AVX2__) && defined(__F16C__)
  const bool pairs = kInt4 && rows <= kPairsMaxRows;
#else
  const bool pairs = false;
#endif
#if defined(__AVX2__) && defined(__F16C__)
  const bool blocks_of_8 = !pairs && rows >= 8;
#else
  const bool blocks_of_8 = false;
#endif
  // Rows in full blocks of 8 go through dot_8rows or dot_tile when blocks_of_8; the rest
  // (and, with dot_tile, the outputs past the last full tile of 8) row block by row block.
  const int64_t blocked_rows = blocks_of_8 ? rows / 8 * 8 : 0;
  const bool tiles = blocked_rows >= kTileMinRows;
  const QuantizedActivations qa =
      quantize_activations(x.data_ptr<float>(), rows, cols, pairs, blocked_rows);
  auto out = at::empty({rows, num_out}, x.options());
  float* op = out.data_ptr<float>();
  // Threads take units of 8 output rows, so that a full unit is the same tile of dot_tile
  // whatever the split (and so the same bits); a short last unit runs row block by row
  // block throughout.
  const int64_t full_units = num_out / 8;
  pagedserve::parallel_for(0, (num_out + 7) / 8, 2, [&](int64_t unit_begin, int64_t unit_end) {
    const int64_t begin = unit_begin * 8, end = std::min(num_out, unit_end * 8);
    // Outputs [begin, blocks_done) have their blocked rows done by the block kernels.
    const int64_t blocks_done = blocked_rows == 0 ? begin
                                : tiles       ? std::max(begin, std::min(unit_end, full_units) * 8)
                                              : end;
#if defined(__AVX2__) && defined(__F16C__)
    if (blocked_rows > 0 && !tiles) {
      // One 8-row block at a time over a tile of kTileOut output rows: the block's
      // activations (8 x K int16) stay in L1 while the tile's weight rows pass, where an
      // output row at a time would stream every row's activations from L2 per output row
      // (linear_chain, 32 rows, int4: 136 vs 155 ms, int8: 107 vs 121 ms, means of 5 and 7
      // interleaved runs on a noisy VM; 8 rows within noise).
      for (int64_t tile = begin; tile < end; tile += kTileOut) {
        const int64_t tile_end = std::min(end, tile + kTileOut);
        for (int64_t m0 = 0; m0 < blocked_rows; m0 += 8)
          for (int64_t n = tile; n < tile_end; ++n)
            dot_8rows<kInt4>(weight + n * row_bytes, scales + n * groups,
                             kInt4 ? mins + n * groups : nullptr, groups, qa, rows, m0, op + n,
                             num_out);
      }
    } else if (tiles) {
      std::vector<__m256> acc;
      for (int64_t n = begin; n < blocks_done; n += 8)
        dot_tile<kInt4>(weight, row_bytes, scales, mins, groups, qa, cols, blocked_rows, n, op,
                        num_out, acc);
    }
#endif
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* wrow = weight + n * row_bytes;
      const uint16_t* srow = scales + n * groups;
      const uint16_t* mrow = kInt4 ? mins + n * groups : nullptr;
      float* o = op + n;
#if defined(__AVX2__) && defined(__F16C__)
      if (pairs) {
        dot_rows_int4<1>(wrow, srow, mrow, groups, qa, 0, o, num_out);
        continue;
      }
#endif
      int64_t m0 = n < blocks_done ? blocked_rows : 0;
      for (; m0 + kRowBlock <= rows; m0 += kRowBlock)
        dot_rows<kInt4, kRowBlock>(wrow, srow, mrow, groups, qa, m0, o, num_out);
      switch (rows - m0) {
        case 3: dot_rows<kInt4, 3>(wrow, srow, mrow, groups, qa, m0, o, num_out); break;
        case 2: dot_rows<kInt4, 2>(wrow, srow, mrow, groups, qa, m0, o, num_out); break;
        case 1: dot_rows<kInt4, 1>(wrow, srow, mrow, groups, qa, m0, o, num_out); break;
        default: break;
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor int4_linear(at::Tensor x, at::Tensor packed, at::Tensor scales,
                          at::Tensor mins) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous(),
              "packed must be a contiguous uint8 [N, K / 2] tensor");
  const int64_t num_out = packed.size(0), in_features = packed.size(1) * 2;
  check_common(x, scales, num_out, in_features);
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == at::kHalf &&
                  mins.is_contiguous(),
              "mins must be a contiguous float16 tensor shaped like scales");
  return quant_linear<true>(x, packed.data_ptr<uint8_t>(), in_features / 2,
                            halves(scales), halves(mins), num_out);
}

at::Tensor int8_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar &&
                  qweight.is_contiguous(),
              "qweight must be a contiguous int8 [N, K] tensor");
  const int64_t num_out = qweight.size(0), in_features = qweight.size(1);
  check_common(x, scales, num_out, in_features);
  return quant_linear<false>(x, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()),
                             in_features, halves(scales), nullptr, num_out);
}
