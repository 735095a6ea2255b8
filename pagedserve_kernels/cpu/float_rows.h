// A float32 view of float32 / bfloat16 / float16 tensors for kernels that compute in float32
// and hand back their input's dtype (quant_blocked.cpp, paged_attention.cpp): the input
// widened (exact), the result rounded once (round to nearest even, as Tensor.to).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "vec8.h"

namespace pagedserve {

inline bool float_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

// t's values as float32: t's own data, or widened into `buffer`. t contiguous.
inline const float* float_values(const at::Tensor& t, std::vector<float>& buffer) {
  if (t.scalar_type() == at::kFloat) return t.data_ptr<float>();
  buffer.resize(t.numel());
  if (t.scalar_type() == at::kBFloat16) {
    load_floats(t.data_ptr<c10::BFloat16>(), buffer.data(), t.numel());
  } else {
    load_floats(t.data_ptr<c10::Half>(), buffer.data(), t.numel());
  }
  return buffer.data();
}

// n float32 values rounded into t's elements [offset, offset + n) (bfloat16 / float16 t; a
// float32 t is where they were computed: nothing to do). t contiguous.
inline void round_into(const float* values, const at::Tensor& t, int64_t offset, int64_t n) {
  if (t.scalar_type() == at::kBFloat16) {
    store_floats(values, t.data_ptr<c10::BFloat16>() + offset, n);
  } else if (t.scalar_type() == at::kHalf) {
    store_floats(values, t.data_ptr<c10::Half>() + offset, n);
  }
}

}  // namespace pagedserve
