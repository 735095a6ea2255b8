// The LoRA side path of one linear for every adapter in a step, in one call (the shape of
// Punica's SGMV: shrink, then expand, grouped by adapter; engine/lora/layers.py).
//
// For each group g (an adapter and the rows of its tokens):
//   s = x[rows] A_g^T                                   [rows, P * r]   (shrink)
//   out[rows, piece p's columns] += s[:, p*r : (p+1)*r] B_g,p^T          (expand)
// A_g stacks the A of each adapted piece [P * r, K]; B_g stacks their B transposed
// ([r, sum of the pieces' columns]), in one dtype; pieces_g [P, 2] holds each piece's (first output column, columns).
//
// Worked example, qkv with q 64 columns, k 16, v 16, an adapter of rank 8 on q and v:
//   A [16, K] = A_q | A_v, B^T [8, 80] = B_q^T (columns 0..63) | B_v^T (columns 64..79),
//   pieces [[0, 64], [80, 16]]: out column c < 64 gets s[:, 0:8] . B^T[:, c], out
//   column 80 + j gets s[:, 8:16] . B^T[:, 64 + j].
//
// Float32 math (x and the adapter's weights, float32 / bfloat16 / float16, widened; each
// dot a float sum in a fixed order), rounded once into out's dtype: a row's result does
// not depend on the other rows. Tasks are blocks of A rows (shrink) and of B rows (expand)
// of every group at once, so one call spreads all the step's adapters over the threads.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "ops.h"
#include "spin_pool.h"
#include "vec8.h"

namespace {

constexpr int64_t kShrinkBlock = 8;   // A rows per task of the shrink
constexpr int64_t kExpandBlock = 64;  // output columns per task of the expand

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(c10::Half v) { return static_cast<float>(v); }

// x (float32) . w (the adapter's dtype), n values: two vector accumulators, then the tail.
template <typename W>
inline float dot(const float* x, const W* w, int64_t n) {
  vec8 acc0 = {}, acc1 = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 += load8(x + i) * load8(w + i);
    acc1 += load8(x + i + 8) * load8(w + i + 8);
  }
  for (; i + 8 <= n; i += 8) acc0 += load8(x + i) * load8(w + i);
  float sum = sum8(acc0 + acc1);
  for (; i < n; ++i) sum += x[i] * widen(w[i]);
  return sum;
}

// One adapter group of the call: its rows, its A / B^T and its pieces.
template <typename W>
struct Group {
  std::vector<int64_t> rows;
  const W* a = nullptr;
  const W* b_t = nullptr;  // [r, columns]: piece p's columns start at b_col[p]
  int64_t stacked = 0, rank = 0, columns = 0;
  std::vector<int64_t> out_start, size, b_col;  // per piece
  std::vector<float> s;                         // [rows, stacked], the shrink's result
};

template <typename T, typename W>
void add_groups(at::Tensor& out, const at::Tensor& x, std::vector<Group<W>>& groups) {
  const int64_t num_tokens = x.size(0), in_features = x.size(1);
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // x widened to float32 once (each token belongs to one group).
  std::vector<float> xs(num_tokens * in_features);
  pagedserve::parallel_for(0, num_tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t k = 0; k < in_features; ++k)
        xs[t * in_features + k] = widen(xp[t * x_stride + k]);
  });
  // Tasks: (group, first A row) blocks for the shrink, (group, piece, first column)
  // blocks for the expand; each reads its block of weights once for all the group's rows.
  std::vector<std::pair<int64_t, int64_t>> shrink;
  std::vector<std::tuple<int64_t, int64_t, int64_t>> expand;
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g) {
    for (int64_t j = 0; j < groups[g].stacked; j += kShrinkBlock) shrink.emplace_back(g, j);
    for (size_t p = 0; p < groups[g].size.size(); ++p)
      for (int64_t c = 0; c < groups[g].size[p]; c += kExpandBlock)
        expand.emplace_back(g, static_cast<int64_t>(p), c);
  }
  pagedserve::parallel_for(0, static_cast<int64_t>(shrink.size()), 1, [&](int64_t begin,
                                                                          int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      Group<W>& group = groups[shrink[task].first];
      const int64_t j0 = shrink[task].second;
      const int64_t j1 = std::min(j0 + kShrinkBlock, group.stacked);
      for (size_t i = 0; i < group.rows.size(); ++i)
        for (int64_t j = j0; j < j1; ++j)
          group.s[i * group.stacked + j] =
              dot(xs.data() + group.rows[i] * in_features, group.a + j * in_features, in_features);
    }
  });
  // The expand as rank-many axpys over a block of contiguous columns of B^T (no
  // horizontal sums): acc[c] = sum_k s[i, p*r + k] * B^T[k, c], then out += acc.
  pagedserve::parallel_for(0, static_cast<int64_t>(expand.size()), 1, [&](int64_t begin,
                                                                          int64_t end) {
    alignas(32) float acc[kExpandBlock];
    for (int64_t task = begin; task < end; ++task) {
      const auto [g, p, c0] = expand[task];
      const Group<W>& group = groups[g];
      const int64_t width = std::min(kExpandBlock, group.size[p] - c0);
      const W* b_block = group.b_t + group.b_col[p] + c0;
      for (size_t i = 0; i < group.rows.size(); ++i) {
        const float* s_row = group.s.data() + i * group.stacked + p * group.rank;
        std::fill(acc, acc + width, 0.0f);
        for (int64_t k = 0; k < group.rank; ++k) {
          const W* b_row = b_block + k * group.columns;
          vec8 sk;
          for (int l = 0; l < 8; ++l) sk[l] = s_row[k];
          int64_t c = 0;
          for (; c + 8 <= width; c += 8) {
            const vec8 v = load8(acc + c) + sk * load8(b_row + c);
            std::memcpy(acc + c, &v, sizeof v);
          }
          for (; c < width; ++c) acc[c] += s_row[k] * widen(b_row[c]);
        }
        T* out_row = op + group.rows[i] * out_stride + group.out_start[p] + c0;
        for (int64_t c = 0; c < width; ++c)
          out_row[c] = static_cast<T>(widen(out_row[c]) + acc[c]);
      }
    }
  });
}

template <typename W>
std::vector<Group<W>> make_groups(int64_t num_tokens, int64_t out_features,
                                  const std::vector<at::Tensor>& rows,
                                  const std::vector<at::Tensor>& a,
                                  const std::vector<at::Tensor>& b,
                                  const std::vector<at::Tensor>& pieces) {
  std::vector<Group<W>> groups(a.size());
  for (size_t g = 0; g < a.size(); ++g) {
    Group<W>& group = groups[g];
    group.a = a[g].data_ptr<W>();
    group.b_t = b[g].data_ptr<W>();
    group.stacked = a[g].size(0);
    group.rank = b[g].size(0);
    group.columns = b[g].size(1);
    const int64_t* pp = pieces[g].data_ptr<int64_t>();
    int64_t b_col = 0;
    for (int64_t p = 0; p < pieces[g].size(0); ++p) {
      TORCH_CHECK(pp[2 * p] >= 0 && pp[2 * p + 1] >= 0 &&
                      pp[2 * p] + pp[2 * p + 1] <= out_features,
                  "lora_add_: a piece passes out's columns");
      group.out_start.push_back(pp[2 * p]);
      group.size.push_back(pp[2 * p + 1]);
      group.b_col.push_back(b_col);
      b_col += pp[2 * p + 1];
    }
    TORCH_CHECK(b_col == group.columns, "lora_add_: B^T has ", group.columns,
                " columns, the pieces ", b_col);
    // Undefined or empty rows: every token of the step.
    if (rows[g].defined() && rows[g].numel() > 0) {
      TORCH_CHECK(rows[g].scalar_type() == at::kLong && rows[g].is_contiguous(),
                  "lora_add_: rows int64");
      const int64_t* rp = rows[g].data_ptr<int64_t>();
      group.rows.assign(rp, rp + rows[g].numel());
      for (int64_t r : group.rows)
        TORCH_CHECK(r >= 0 && r < num_tokens, "lora_add_: row ", r, " of ", num_tokens);
    } else {
      for (int64_t r = 0; r < num_tokens; ++r) group.rows.push_back(r);
    }
    group.s.assign(group.rows.size() * group.stacked, 0.0f);
  }
  return groups;
}

// Calls f(value of the C++ type) for float32, bfloat16 or float16.
template <typename F>
void with_float_type(at::ScalarType type, const char* what, const F& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "lora_add_: ", what, " must be float32, bfloat16 or float16");
  }
}

}  // namespace

void lora_add_(at::Tensor out, at::Tensor x, std::vector<at::Tensor> rows,
               std::vector<at::Tensor> a, std::vector<at::Tensor> b,
               std::vector<at::Tensor> pieces) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) &&
                  x.stride(1) == 1 && out.stride(1) == 1 && x.scalar_type() == out.scalar_type() &&
                  x.device().is_cpu() && out.device().is_cpu(),
              "lora_add_: x [T, K] and out [T, N] on the CPU, same dtype, rows contiguous");
  TORCH_CHECK(rows.size() == a.size() && a.size() == b.size() && b.size() == pieces.size() &&
                  !a.empty(),
              "lora_add_: one rows / A / B / pieces entry per adapter group");
  const auto weight_type = a[0].scalar_type();
  for (size_t g = 0; g < a.size(); ++g)
    TORCH_CHECK(a[g].scalar_type() == weight_type && b[g].scalar_type() == weight_type &&
                    a[g].is_contiguous() && b[g].is_contiguous() && a[g].size(1) == x.size(1) &&
                    a[g].size(0) == pieces[g].size(0) * b[g].size(0) &&
                    pieces[g].scalar_type() == at::kLong && pieces[g].is_contiguous(),
                "lora_add_: A [P * r, K], B^T [r, columns] (one dtype), pieces int64 [P, 2]");
  with_float_type(weight_type, "the adapter's weights", [&](auto weight) {
    using W = decltype(weight);
    auto groups = make_groups<W>(x.size(0), out.size(1), rows, a, b, pieces);
    with_float_type(x.scalar_type(), "x", [&](auto value) {
      add_groups<decltype(value), W>(out, x, groups);
    });
  });
}
