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
// Its torch reference is pagedserve_kernels.reference.quant_linear_ref. Each thread takes a range
// of output rows n; x's rows are taken four at a time, so a group's weights are
// decoded once for four rows (dot_rows); an int4 batch of one row (a one-client
// decode step) takes dot_rows_int4, which decodes two groups per load and scales eight
// groups per vector instruction.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "group32_activations.h"
#include "ops.h"
#include "spin_pool.h"

#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace pagedserve::group32;  // kGroup, half_to_float, quantize_activations

#if defined(__AVX2__) && defined(__F16C__)
inline __m256 load_halves(const uint16_t* p) {  // 8 float16 -> 8 float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
constexpr int64_t kRowBlock = 4;  // rows of x sharing one decode of a weight group

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
// out[m, n] for the 8 rows m0..m0+7 and one output row n. dot_rows scales each row's
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
// take dot_8rows for each full block of 8 rows (AVX2; faster than dot_rows alone at 8 and
// 32 rows) and the per-group loop (dot_rows, each weight group decoded once for kRowBlock
// rows) for the rest. Why dot_rows_int4 stops at one row: it keeps 4 pairs' sums per row
// in registers, and with more than 2 rows they spill (it ties at 2 rows and loses at 4).
// The figures: docs/performance.md, "Figures behind choices in the code".
constexpr int64_t kPairsMaxRows = 1;
// --batch-invariant: every row takes dot_rows (the same arithmetic whatever the batch).
std::atomic<bool> g_batch_invariant{false};
constexpr int64_t kTileOut = 16;  // output rows per pass over one 8-row block (see below)

template <bool kInt4>
at::Tensor quant_linear(const at::Tensor& x, const uint8_t* weight, int64_t row_bytes,
                        const uint16_t* scales, const uint16_t* mins, int64_t num_out) {
  const int64_t rows = x.size(0), cols = x.size(1), groups = cols / kGroup;
#if defined(__AVX2__) && defined(__F16C__)
  const bool invariant = g_batch_invariant.load(std::memory_order_relaxed);
  const bool pairs = !invariant && kInt4 && rows <= kPairsMaxRows;
  const bool blocks_of_8 = !invariant && !pairs && rows >= 8;
#else
  const bool pairs = false, blocks_of_8 = false;
#endif
  // With 8-bit activations (group32_activations.h) this file's int16 code takes the
  // int8-valued xq: the same results as an 8-bit kernel would give.
  const QuantizedActivations qa = quantize_activations(
      x.data_ptr<float>(), rows, cols, pairs, blocks_of_8, activation_levels(activation_bits()));
  auto out = at::empty({rows, num_out}, x.options());
  float* op = out.data_ptr<float>();
  // Rows in full blocks of 8 (dot_8rows) when blocks_of_8; the rest row block by row block.
  const int64_t blocked_rows = blocks_of_8 ? rows / 8 * 8 : 0;
  pagedserve::parallel_for(0, num_out, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX2__) && defined(__F16C__)
    // One 8-row block at a time over a tile of kTileOut output rows: the block's
    // activations (8 x K int16) stay in L1 while the tile's weight rows pass, where an
    // output row at a time would stream every row's activations from L2 per output row
    // (faster at 32 rows, within noise at 8: docs/performance.md).
    for (int64_t tile = begin; tile < end; tile += kTileOut) {
      const int64_t tile_end = std::min(end, tile + kTileOut);
      for (int64_t m0 = 0; m0 < blocked_rows; m0 += 8)
        for (int64_t n = tile; n < tile_end; ++n)
          dot_8rows<kInt4>(weight + n * row_bytes, scales + n * groups,
                           kInt4 ? mins + n * groups : nullptr, groups, qa, rows, m0, op + n,
                           num_out);
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
      int64_t m0 = blocked_rows;
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

void set_batch_invariant(bool enabled) { g_batch_invariant.store(enabled); }

void set_activation_precision(int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 16, "activation precision must be 8 or 16 bits, not ", bits);
  set_activation_bits(static_cast<int>(bits));
}

int64_t activation_precision() { return activation_bits(); }

at::Tensor int4_linear(at::Tensor x, at::Tensor packed, at::Tensor scales,
                          at::Tensor mins) {
  if (is_blocked(packed)) return blocked_int4_linear(x, packed, scales, mins);
  if (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf)  // computed in float32
    return int4_linear(x.to(at::kFloat), packed, scales, mins).to(x.scalar_type());
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

at::Tensor int8_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales,
                       c10::optional<at::Tensor> mins) {
  const at::Tensor given_mins = mins.value_or(at::Tensor());
  if (is_blocked(qweight)) return blocked_int8_linear(x, qweight, scales, given_mins);
  if (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf)  // computed in float32
    return int8_linear(x.to(at::kFloat), qweight, scales, mins).to(x.scalar_type());
  TORCH_CHECK(!has_mins(given_mins), "row-major int8 weights have no mins");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar &&
                  qweight.is_contiguous(),
              "qweight must be a contiguous int8 [N, K] tensor");
  const int64_t num_out = qweight.size(0), in_features = qweight.size(1);
  check_common(x, scales, num_out, in_features);
  return quant_linear<false>(x, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()),
                             in_features, halves(scales), nullptr, num_out);
}
