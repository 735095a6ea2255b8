// The int8 KV cache's rows (engine/attention/kv_int8.py): each (token, KV head) row of K
// or V is head_size int8 values q and their float32 scale s, head_size + 4 bytes, the value
// being s * q. Written by fused_ops.cpp (write_kv_cache), read by paged_attention.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagedserve::kv_int8 {

constexpr int64_t kScaleBytes = 4;  // the float32 scale after a row's values

// The scale stored after a row's head_size values.
inline float row_scale(const int8_t* row, int64_t head_size) {
  float scale;
  std::memcpy(&scale, row + head_size, sizeof scale);
  return scale;
}

// src[0 .. dim) as one row: scale = max |x| / 127 and q = round_half_even(x / scale) (x / 1
// for a row of zeros), the same float32 operations as the torch reference (quantize_rows),
// so the same bytes. Example, x = (0.5, -1.27, 0, 0.02): scale 0.01, q = (50, -127, 0, 2).
template <typename in_t>
inline void quantize_row(const in_t* src, int64_t dim, int8_t* dst) {
  float max_abs = 0.f;
  for (int64_t d = 0; d < dim; ++d) max_abs = std::max(max_abs, std::fabs(static_cast<float>(src[d])));
  const float scale = max_abs / 127.f;
  const float divisor = scale > 0.f ? scale : 1.f;
  for (int64_t d = 0; d < dim; ++d) {
    const float q = std::nearbyint(static_cast<float>(src[d]) / divisor);
    dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  std::memcpy(dst + dim, &scale, sizeof scale);
}

}  // namespace pagedserve::kv_int8
