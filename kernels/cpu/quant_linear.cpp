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
// A decode step multiplies few rows (M small) by every weight once: the kernel is
// bound by the bytes of W it reads (0.625 / 1.125 bytes per weight here against 4 for
// float32). Each thread takes a range of output rows n, decodes each group of 32
// weights once and uses it for all M rows of x. The `mins` term is factored out:
// sum_k x[k] (m + d q[k]) = m * sum_k x[k] + d * sum_k x[k] q[k], with the group sums
// of x computed once per call. float32 throughout.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec8.h"

namespace {

constexpr int64_t kGroup = 32;
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int8_t i8x8 __attribute__((vector_size(8)));

// The 32 quantized values of one group as four vectors of 8 floats (unscaled).
inline void decode_int4(const uint8_t* bytes, vec8 out[4]) {
#if defined(__AVX2__)
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  out[0] = (vec8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
  out[1] = (vec8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
  out[2] = (vec8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
  out[3] = (vec8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
#else
  u8x8 b0, b1;
  std::memcpy(&b0, bytes, 8);
  std::memcpy(&b1, bytes + 8, 8);
  out[0] = __builtin_convertvector(b0 & 0x0F, vec8);
  out[1] = __builtin_convertvector(b1 & 0x0F, vec8);
  out[2] = __builtin_convertvector(b0 >> 4, vec8);
  out[3] = __builtin_convertvector(b1 >> 4, vec8);
#endif
}

inline void decode_int8(const int8_t* values, vec8 out[4]) {
#if defined(__AVX2__)
  for (int i = 0; i < 4; ++i) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(values + 8 * i));
    out[i] = (vec8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  }
#else
  for (int i = 0; i < 4; ++i) {
    i8x8 v;
    std::memcpy(&v, values + 8 * i, 8);
    out[i] = __builtin_convertvector(v, vec8);
  }
#endif
}

void check_common(const torch::Tensor& x, const torch::Tensor& scales, int64_t num_out,
                  int64_t in_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == in_features, "x has ", x.size(1), " columns, the weight ",
              in_features);
  TORCH_CHECK(in_features % kGroup == 0, "in_features must be a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == num_out &&
                  scales.size(1) == in_features / kGroup,
              "scales must be a contiguous float32 [N, K / 32] tensor");
}

// Shared loop: for each output row n and group g, decode the group and scale it, then for
// every row m of x accumulate x * (scale * q) (vector accumulators, one horizontal sum per
// output) and min * sum(x group).
template <bool kInt4>
torch::Tensor quant_linear(const torch::Tensor& x, const uint8_t* weight, int64_t row_bytes,
                           const float* scales, const float* mins, int64_t num_out) {
  const int64_t num_rows = x.size(0), in_features = x.size(1);
  const int64_t num_groups = in_features / kGroup;
  const float* xp = x.data_ptr<float>();
  auto out = torch::empty({num_rows, num_out}, x.options());
  float* op = out.data_ptr<float>();
  std::vector<float> xsum;
  if (mins != nullptr) {
    xsum.assign(num_rows * num_groups, 0.f);
    for (int64_t m = 0; m < num_rows; ++m)
      for (int64_t g = 0; g < num_groups; ++g) {
        const float* xg = xp + m * in_features + g * kGroup;
        xsum[m * num_groups + g] =
            sum8(load8(xg) + load8(xg + 8) + load8(xg + 16) + load8(xg + 24));
      }
  }
  at::parallel_for(0, num_out, 16, [&](int64_t begin, int64_t end) {
    // Four independent accumulators per row of x (one per 8 columns of a group), so
    // consecutive groups' FMAs do not wait on each other.
    std::vector<vec8> acc(num_rows * 4);
    std::vector<float> acc_min(num_rows);
    vec8 q[4];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* wrow = weight + n * row_bytes;
      const float* srow = scales + n * num_groups;
      for (int64_t i = 0; i < num_rows * 4; ++i) acc[i] = vec8{};
      for (int64_t m = 0; m < num_rows; ++m) acc_min[m] = 0.f;
      for (int64_t g = 0; g < num_groups; ++g) {
        if (kInt4) {
          decode_int4(wrow + g * (kGroup / 2), q);
        } else {
          decode_int8(reinterpret_cast<const int8_t*>(wrow) + g * kGroup, q);
        }
        const float scale = srow[g];
        for (int j = 0; j < 4; ++j) q[j] *= scale;
        for (int64_t m = 0; m < num_rows; ++m) {
          const float* xg = xp + m * in_features + g * kGroup;
          vec8* a = &acc[m * 4];
          for (int j = 0; j < 4; ++j) a[j] += load8(xg + 8 * j) * q[j];
        }
        if (mins != nullptr) {
          const float mn = mins[n * num_groups + g];
          for (int64_t m = 0; m < num_rows; ++m) acc_min[m] += mn * xsum[m * num_groups + g];
        }
      }
      for (int64_t m = 0; m < num_rows; ++m) {
        const vec8* a = &acc[m * 4];
        op[m * num_out + n] = sum8((a[0] + a[1]) + (a[2] + a[3])) + acc_min[m];
      }
    }
  });
  return out;
}

}  // namespace

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          torch::Tensor mins) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 &&
                  packed.is_contiguous(),
              "packed must be a contiguous uint8 [N, K / 2] tensor");
  const int64_t num_out = packed.size(0), in_features = packed.size(1) * 2;
  check_common(x, scales, num_out, in_features);
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == torch::kFloat32 &&
                  mins.is_contiguous(),
              "mins must be a contiguous float32 tensor shaped like scales");
  return quant_linear<true>(x, packed.data_ptr<uint8_t>(), in_features / 2,
                            scales.data_ptr<float>(), mins.data_ptr<float>(), num_out);
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == torch::kInt8 &&
                  qweight.is_contiguous(),
              "qweight must be a contiguous int8 [N, K] tensor");
  const int64_t num_out = qweight.size(0), in_features = qweight.size(1);
  check_common(x, scales, num_out, in_features);
  return quant_linear<false>(x, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()),
                             in_features, scales.data_ptr<float>(), nullptr, num_out);
}
