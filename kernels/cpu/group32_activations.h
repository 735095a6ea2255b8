// Shared by the int4/int8 kernels (quant_linear.cpp, quant_blocked.cpp): x rounded to int16
// per row and group of 32 columns, and float16 scale helpers. The rounding's error bound
// is worked out at the top of quant_linear.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedserve::group32 {

constexpr int64_t kGroup = 32;

// Scales and mins are float16 (GGUF's own precision for Q4_0 / Q4_1 / Q8_0).
inline float half_to_float(uint16_t bits) {
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// A float16 tensor's bits.
inline const uint16_t* halves(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

// x [M, K] float32 -> xq int16, dx [M, G], sums [M, G] = dx * sum(xq) per group.
// xq holds `stride` int16 per row: K in natural order, or (`pairs`, the int4 kernel's
// layout) each pair of groups (g, g + 1) interleaved in runs of 8, the order in which
// one 32-byte load of their packed weights unpacks (see dot_rows_int4):
//   [g 0-7, g+1 0-7, g 8-15, g+1 8-15, g 16-23, g+1 16-23, g 24-31, g+1 24-31]
// Example, K = 96 (3 groups): stride 128; the last pair is group 2 with a zero group 3.
// With `transposed`, scales_t / sums_t hold the same values as [G, M] (group-major), so
// that the 8 rows of a block (dot_8rows) read their scales of one group in one load.
struct QuantizedActivations {
  std::vector<int16_t> values;
  std::vector<float> scales, sums, scales_t, sums_t;
  int64_t stride = 0;
};

inline QuantizedActivations quantize_activations(const float* x, int64_t rows, int64_t cols,
                                          bool pairs, bool transposed) {
  const int64_t groups = cols / kGroup;
  QuantizedActivations qa;
  qa.stride = pairs ? (groups + 1) / 2 * 2 * kGroup : cols;
  qa.values.assign(rows * qa.stride, 0);
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
      int32_t sum = 0;
      for (int64_t k = 0; k < kGroup; ++k) {
        const int16_t q = static_cast<int16_t>(std::nearbyint(xg[k] * inverse));
        // pairs: run k / 8 of group g sits at run 2 (k / 8) + g % 2 of the pair's 64.
        const int64_t at = pairs ? (g / 2) * 2 * kGroup + (2 * (k / 8) + g % 2) * 8 + k % 8
                                 : g * kGroup + k;
        row[at] = q;
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

}  // namespace pagedserve::group32
