// The small ops between a decoder layer's matmuls, one call each instead of the 5-10
// torch ops (and as many temporary tensors) that each costs in eager mode:
//
//   rms_norm            out = w * x / sqrt(mean(x^2) + eps)
//   add_rms_norm_       residual += x; x = w * residual / sqrt(mean(residual^2) + eps)
//   rotary_neox_        q, k rotated in place by cos/sin (halves, not interleaved pairs)
//   silu_and_mul        out = silu(x[:, :I]) * x[:, I:]
//   write_kv_cache      k, v of each token into its slot of the head-major paged cache
//
// Each matches its torch reference in engine/models (layers.py, rotary.py) and
// engine/attention/backends/torch_backend.py, including where that reference rounds
// to the model's dtype (bf16/fp16): the arithmetic is float32, rounded at the same
// points as the torch ops round. float32, bfloat16 and float16 tensors, CPU.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kv_int8_rows.h"
#include "spin_pool.h"
#include "vec8.h"

namespace {

// float64 tensors are accepted too (the dispatch macros include them), computed in float32.
using ::load8;  // vec8.h's overloads, which this one would otherwise hide
inline vec8 load8(const double* p) {
  vec8 v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
using ::store_floats;
inline void store_floats(const float* x, double* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i];
}

// Round a float32 to the tensor's dtype and back (identity for float32).
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Rows handled per parallel task: at least 64K elements. These ops read each value
// once, so below that a fork-join (waking the other threads, waiting for the slowest)
// costs more than it saves: a decode batch of 32 stays on one thread, a prefill
// chunk of 512 tokens is split.
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 65536 / row_elems); }

template <typename T>
void rms_norm_row(T* out, const T* x, const T* weight, int64_t n, float eps) {
  vec8 squares = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const vec8 v = load8(x + i);
    squares += v * v;
  }
  float sum_sq = sum8(squares);
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    sum_sq += v * v;
  }
  const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    // torch: weight * (x.float() * rsqrt(...)).to(dtype)
    out[i] = static_cast<T>(static_cast<float>(weight[i]) *
                            round_to<T>(static_cast<float>(x[i]) * inv_rms));
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a CPU [rows, n] tensor with contiguous rows");
}

// exp(x) for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6
// Taylor polynomial (relative error < 2e-7 there), 2^n put into the exponent bits.
inline vec8 exp8(vec8 x) {
  typedef int32_t ivec8 __attribute__((vector_size(32)));
  x = x < vec8{} - 87.f ? vec8{} - 87.f : x;
  x = x > vec8{} + 88.f ? vec8{} + 88.f : x;
  const vec8 t = x * 1.44269504f;  // x / ln2
  const ivec8 n = __builtin_convertvector(t + (t >= 0.f ? vec8{} + 0.5f : vec8{} - 0.5f), ivec8);
  const vec8 nf = __builtin_convertvector(n, vec8);
  const vec8 r = (x - nf * 0.693145752f) - nf * 1.42860677e-6f;  // ln2 split in two parts
  vec8 p = vec8{} + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  vec8 scale;
  const ivec8 bits = (n + 127) << 23;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace

// out[t] = rms_norm(x[t]) * weight; out may be x.
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "rms_norm: out like x, weight [n] in x's dtype");
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    pagedserve::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(op + r * os, xp + r * xs, wp, n, static_cast<float>(eps));
    });
  });
}

// residual = x + residual (rounded to the dtype, as torch's add); x = rms_norm(residual).
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "add_rms_norm_: residual like x, weight [n] in x's dtype");
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), rs = residual.stride(0);
    pagedserve::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = xp + r * xs;
        scalar_t* res = rp + r * rs;
        for (int64_t i = 0; i < n; ++i)
          res[i] = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(res[i]));
        rms_norm_row(xr, res, wp, n, static_cast<float>(eps));
      }
    });
  });
}

// Rotate the first rotary_dim = cos.size(1) dims of each head of q [T, Hq, D] and
// k [T, Hk, D] in place (any token and head strides, contiguous head dims):
//   x = [x1 | x2 | rest] -> [x1 cos - x2 sin | x2 cos + x1 sin | rest]
// cos, sin: float32 [T, rotary_dim], each row [c | c] (the two halves equal).
// Like the torch reference, cos and sin are first rounded to the dtype and every
// product and sum is rounded to it.
void rotary_neox_(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
                  q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.scalar_type() == k.scalar_type() && q.device().is_cpu(),
              "rotary_neox_: q [T, Hq, D], k [T, Hk, D] on the CPU, same dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) <= q.size(2) &&
                  cos.size(1) % 2 == 0,
              "rotary_neox_: cos, sin contiguous float32 [T, rotary_dim <= D], rotary_dim even");
  const int64_t tokens = q.size(0), half = cos.size(1) / 2, rot = cos.size(1);
  const int64_t heads_q = q.size(1), heads_k = k.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_neox_", [&] {
    auto rotate = [&](scalar_t* x, const float* c, const float* s) {
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
        const float c1 = round_to<scalar_t>(c[i]), s1 = round_to<scalar_t>(s[i]);
        const float c2 = round_to<scalar_t>(c[i + half]), s2 = round_to<scalar_t>(s[i + half]);
        const float a = round_to<scalar_t>(x1 * c1), b = round_to<scalar_t>(-x2 * s1);
        const float e = round_to<scalar_t>(x2 * c2), f = round_to<scalar_t>(x1 * s2);
        x[i] = static_cast<scalar_t>(a + b);
        x[i + half] = static_cast<scalar_t>(e + f);
      }
    };
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    pagedserve::parallel_for(0, tokens, grain_rows((heads_q + heads_k) * rot), [&](int64_t begin,
                                                                            int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cp + t * rot;
        const float* s = sp + t * rot;
        for (int64_t h = 0; h < heads_q; ++h) rotate(qp + t * q.stride(0) + h * q.stride(1), c, s);
        for (int64_t h = 0; h < heads_k; ++h) rotate(kp + t * k.stride(0) + h * k.stride(1), c, s);
      }
    });
  });
}

// out [T, I] = silu(x[:, :I]) * x[:, I:] for x [T, 2I]; silu(g) = g / (1 + exp(-g)),
// rounded to the dtype before the product (as torch's F.silu(gate) * up).
constexpr int64_t kSiluBlock = 256;

void silu_and_mul(at::Tensor out, at::Tensor x) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(1) % 2 == 0 && out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2 &&
                  out.scalar_type() == x.scalar_type(),
              "silu_and_mul: x [T, 2I], out [T, I] in x's dtype");
  const int64_t rows = x.size(0), inner = out.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    pagedserve::parallel_for(0, rows, grain_rows(inner), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = xp + r * xs;
        const scalar_t* u = g + inner;
        scalar_t* o = op + r * os;
        // 256 values at a time: silu in float32, rounded to the dtype (store_floats:
        // round to nearest even, vectorized; a copy for float32), times up, rounded again.
        float buffer[kSiluBlock];
        scalar_t rounded[kSiluBlock];
        for (int64_t block = 0; block < inner; block += kSiluBlock) {
          const int64_t n = std::min<int64_t>(kSiluBlock, inner - block);
          int64_t i = 0;
          for (; i + 8 <= n; i += 8) {
            const vec8 gv = load8(g + block + i);
            const vec8 silu = gv / (1.f + exp8(-gv));
            std::memcpy(buffer + i, &silu, sizeof silu);
          }
          for (; i < n; ++i) {  // the row's last inner % 8 values
            const float gate = static_cast<float>(g[block + i]);
            buffer[i] = gate / (1.f + std::exp(-gate));
          }
          store_floats(buffer, rounded, n);
          for (i = 0; i + 8 <= n; i += 8) {
            const vec8 product = load8(rounded + i) * load8(u + block + i);
            std::memcpy(buffer + i, &product, sizeof product);
          }
          for (; i < n; ++i)
            buffer[i] = static_cast<float>(rounded[i]) * static_cast<float>(u[block + i]);
          store_floats(buffer, o + block, n);
        }
      }
    });
  });
}

namespace {

// fn(src, kv, h, slot) for each (token, K|V, head) row to write: src points at the row of
// `key` (kv 0) or `value` (kv 1), head h, of a token whose slot is >= 0; tokens split
// over the threads.
template <typename in_t, typename Fn>
void for_each_row(const at::Tensor& key, const at::Tensor& value, int64_t heads, int64_t dim,
                  const int64_t* slots, int64_t tokens, const Fn& fn) {
  const in_t* sources[2] = {key.data_ptr<in_t>(), value.data_ptr<in_t>()};
  const int64_t token_strides[2] = {key.stride(0), value.stride(0)};
  const int64_t head_strides[2] = {key.stride(1), value.stride(1)};
  pagedserve::parallel_for(0, tokens, grain_rows(2 * heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      for (int kv = 0; kv < 2; ++kv)
        for (int64_t h = 0; h < heads; ++h)
          fn(sources[kv] + t * token_strides[kv] + h * head_strides[kv], kv, h, slots[t]);
    }
  });
}

}  // namespace

// kv_cache[0 | 1, h, slot / block_size, slot % block_size, :] = key | value [t, h, :]
// for every token t whose slot_mapping[t] >= 0 (-1 marks padding), cast to the cache
// dtype (an int8 cache: each row quantized, kv_int8_rows.h). key, value [T, Hkv, D] (any token and
// head strides); kv_cache [2, Hkv, num_blocks, block_size, D] contiguous (int8: D + 4);
// slot_mapping int64 [T].
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache,
                    at::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.device().is_cpu(),
              "write_kv_cache: kv_cache must be a contiguous CPU [2, Hkv, blocks, block_size, D] (int8: D + 4)");
  const int64_t heads = kv_cache.size(1), num_slots = kv_cache.size(2) * kv_cache.size(3);
  const bool int8_cache = kv_cache.scalar_type() == at::kChar;  // rows of dim + scale bytes
  const int64_t row = kv_cache.size(4);
  const int64_t dim = int8_cache ? row - pagedserve::kv_int8::kScaleBytes : row;
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(1) == heads &&
                  key.size(2) == dim && key.stride(2) == 1 && value.stride(2) == 1 &&
                  key.scalar_type() == value.scalar_type(),
              "write_kv_cache: key, value [T, Hkv, D] matching the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "write_kv_cache: slot_mapping int64 [T]");
  const int64_t tokens = key.size(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots && slots[t] >= -1, "write_kv_cache: slot ", slots[t],
                " outside the cache's ", num_slots, " slots");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "kv_in", [&] {
    using in_t = scalar_t;
    if (int8_cache) {
      int8_t* cache = kv_cache.data_ptr<int8_t>();
      for_each_row<in_t>(key, value, heads, dim, slots, tokens,
                         [&](const in_t* src, int kv, int64_t h, int64_t slot) {
        int8_t* dst = cache + ((kv * heads + h) * num_slots + slot) * row;
        pagedserve::kv_int8::quantize_row(src, dim, dst);
      });
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "kv_out",
                                    [&] {
      using out_t = scalar_t;
      out_t* cache = kv_cache.data_ptr<out_t>();
      for_each_row<in_t>(key, value, heads, dim, slots, tokens,
                         [&](const in_t* src, int kv, int64_t h, int64_t slot) {
        out_t* dst = cache + ((kv * heads + h) * num_slots + slot) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<out_t>(src[d]);
      });
    });
  });
}
