// Weight-only quantized linears for the CPU: out[M, N] = x[M, K] @ W[N, K]^T, where W is
// stored in 4 or 8 bits in groups of 32 input columns with float32 scales, as GGUF's
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
// of output rows n; x's rows are taken four at a time, so a group's weights are
// decoded once for four rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "spin_pool.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowBlock = 4;  // rows of x sharing one decode of a weight group

// x [M, K] float32 -> xq int16 [M, K], dx [M, G], sums [M, G] = dx * sum(xq) per group.
struct QuantizedActivations {
  std::vector<int16_t> values;
  std::vector<float> scales, sums;
};

QuantizedActivations quantize_activations(const float* x, int64_t rows, int64_t cols) {
  const int64_t groups = cols / kGroup;
  QuantizedActivations qa;
  qa.values.resize(rows * cols);
  qa.scales.resize(rows * groups);
  qa.sums.resize(rows * groups);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + m * cols + g * kGroup;
      float amax = 0.f;
      for (int64_t k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(xg[k]));
      const float scale = amax / 32767.f;
      const float inverse = scale > 0.f ? 1.f / scale : 0.f;
      int16_t* q = qa.values.data() + m * cols + g * kGroup;
      int32_t sum = 0;
      for (int64_t k = 0; k < kGroup; ++k) {
        q[k] = static_cast<int16_t>(std::nearbyint(xg[k] * inverse));
        sum += q[k];
      }
      qa.scales[m * groups + g] = scale;
      qa.sums[m * groups + g] = scale * static_cast<float>(sum);
    }
  return qa;
}

#if defined(__AVX2__)
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

// out[m, n] for R rows m0..m0+R-1 and one output row n.
template <bool kInt4, int R>
inline void dot_rows(const uint8_t* wrow, const float* srow, const float* mrow, int64_t groups,
                     const QuantizedActivations& qa, int64_t m0, int64_t cols, float* out,
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
      const int16_t* xq = qa.values.data() + m * cols + g * kGroup;
      // 16 x (int16 * int16 + int16 * int16) -> 8 int32, twice; |sum| < 2^23, exact.
      const __m256i dot = _mm256_add_epi32(
          _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq))),
          _mm256_madd_epi16(w[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16))));
      const float scale = srow[g] * qa.scales[m * groups + g];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale), acc[r]);
      if (kInt4) acc_min[r] += mrow[g] * qa.sums[m * groups + g];
    }
  }
  for (int r = 0; r < R; ++r) out[(m0 + r) * out_stride] = hsum(acc[r]) + acc_min[r];
}
#else
// Portable version of the same arithmetic: integer dot per group, scaled in float.
template <bool kInt4, int R>
inline void dot_rows(const uint8_t* wrow, const float* srow, const float* mrow, int64_t groups,
                     const QuantizedActivations& qa, int64_t m0, int64_t cols, float* out,
                     int64_t out_stride) {
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    float acc = 0.f, acc_min = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const int16_t* xq = qa.values.data() + m * cols + g * kGroup;
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
      acc += static_cast<float>(dot) * (srow[g] * qa.scales[m * groups + g]);
      if (kInt4) acc_min += mrow[g] * qa.sums[m * groups + g];
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
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == num_out &&
                  scales.size(1) == in_features / kGroup,
              "scales must be a contiguous float32 [N, K / 32] tensor");
}

template <bool kInt4>
at::Tensor quant_linear(const at::Tensor& x, const uint8_t* weight, int64_t row_bytes,
                           const float* scales, const float* mins, int64_t num_out) {
  const int64_t rows = x.size(0), cols = x.size(1), groups = cols / kGroup;
  const QuantizedActivations qa = quantize_activations(x.data_ptr<float>(), rows, cols);
  auto out = at::empty({rows, num_out}, x.options());
  float* op = out.data_ptr<float>();
  pagedserve::parallel_for(0, num_out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* wrow = weight + n * row_bytes;
      const float* srow = scales + n * groups;
      const float* mrow = kInt4 ? mins + n * groups : nullptr;
      int64_t m0 = 0;
      for (; m0 + kRowBlock <= rows; m0 += kRowBlock)
        dot_rows<kInt4, kRowBlock>(wrow, srow, mrow, groups, qa, m0, cols, op + n, num_out);
      switch (rows - m0) {
        case 3: dot_rows<kInt4, 3>(wrow, srow, mrow, groups, qa, m0, cols, op + n, num_out); break;
        case 2: dot_rows<kInt4, 2>(wrow, srow, mrow, groups, qa, m0, cols, op + n, num_out); break;
        case 1: dot_rows<kInt4, 1>(wrow, srow, mrow, groups, qa, m0, cols, op + n, num_out); break;
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
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == at::kFloat &&
                  mins.is_contiguous(),
              "mins must be a contiguous float32 tensor shaped like scales");
  return quant_linear<true>(x, packed.data_ptr<uint8_t>(), in_features / 2,
                            scales.data_ptr<float>(), mins.data_ptr<float>(), num_out);
}

at::Tensor int8_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar &&
                  qweight.is_contiguous(),
              "qweight must be a contiguous int8 [N, K] tensor");
  const int64_t num_out = qweight.size(0), in_features = qweight.size(1);
  check_common(x, scales, num_out, in_features);
  return quant_linear<false>(x, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()),
                             in_features, scales.data_ptr<float>(), nullptr, num_out);
}
