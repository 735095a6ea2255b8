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
// not depend on the other rows. Tasks are blocks of 8 A rows (shrink) and of 256 columns of
// B^T (expand) of every group at once, so one call spreads all the step's adapters over the
// threads; inside a task, register tiles (4 rows x 2 A rows, 2 rows x 32 columns) let one
// load of weights serve several rows when a group has many (a prefill).
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "spin_pool.h"
#include "vec8.h"

namespace {

constexpr int64_t kShrinkBlock = 8;   // A rows per task of the shrink
constexpr int64_t kExpandBlock = 256;  // output columns per task of the expand
constexpr int kTileRows = 4;          // rows of x per shrink tile
constexpr int kTileA = 2;             // A rows per shrink tile
constexpr int kExpandRows = 2;        // rows per expand tile
constexpr int kExpandVectors = 4;     // 8-column vectors per expand tile (32 columns)

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(c10::Half v) { return static_cast<float>(v); }


// The shrink's register tile: NR rows of x against NA rows of A, n values each:
// s[i][j] = x_i . a_j. Each dot is one vector accumulator over the 8-value steps, its
// horizontal sum, then the scalar tail: the same order for every tile size, so a row's
// result does not depend on which rows share its tile. NR * NA accumulators, NR + NA loads
// per NR * NA multiply-adds (one dot alone: two loads per multiply-add).
template <int NR, int NA, typename X, typename W>
inline void dot_tile(const X* const* x, const W* const* a, int64_t n, float* const* s,
                     int64_t j) {
  vec8 acc[NR][NA] = {};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    vec8 av[NA];
    for (int q = 0; q < NA; ++q) av[q] = load8(a[q] + k);
    for (int r = 0; r < NR; ++r) {
      const vec8 xv = load8(x[r] + k);
      for (int q = 0; q < NA; ++q) acc[r][q] += xv * av[q];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int q = 0; q < NA; ++q) {
      float sum = sum8(acc[r][q]);
      for (int64_t t = k; t < n; ++t) sum += widen(x[r][t]) * widen(a[q][t]);
      s[r][j + q] = sum;
    }
}

// The expand's register tile: NR rows, NV * 8 contiguous columns of B^T (stride
// `columns`), rank-many multiply-adds per column in k order:
// acc[i][c] = sum_k s_i[k] * B^T[k, c]. One B load serves NR rows.
template <int NR, int NV, typename W>
inline void expand_tile(const float* const* s, const W* b, int64_t columns, int64_t rank,
                        float* const* acc) {
  vec8 sum[NR][NV] = {};
  for (int64_t k = 0; k < rank; ++k) {
    vec8 bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load8(b + k * columns + 8 * v);
    for (int r = 0; r < NR; ++r) {
      const vec8 sk = broadcast8(s[r][k]);
      for (int v = 0; v < NV; ++v) sum[r][v] += sk * bv[v];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) std::memcpy(acc[r] + 8 * v, &sum[r][v], sizeof(vec8));
}

// The same sums one column at a time (a block's last columns past the vectors).
template <typename W>
inline void expand_column(const float* s, const W* b, int64_t columns, int64_t rank,
                          float* acc) {
  float sum = 0.0f;
  for (int64_t k = 0; k < rank; ++k) sum += s[k] * widen(b[k * columns]);
  *acc = sum;
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
  const int64_t in_features = x.size(1);
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
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
      const int64_t num_rows = static_cast<int64_t>(group.rows.size());
      auto x_row = [&](int64_t i) { return xp + group.rows[i] * x_stride; };
      auto s_row = [&](int64_t i) { return group.s.data() + i * group.stacked; };
      // s for rows i .. i + NR - 1: tiles of NA A rows, then the A rows past them one by one.
      auto shrink_rows = [&](int64_t i, auto tile_rows, auto tile_a) {
        constexpr int NR = decltype(tile_rows)::value, NA = decltype(tile_a)::value;
        const T* x[NR];
        float* out[NR];
        for (int r = 0; r < NR; ++r) x[r] = x_row(i + r), out[r] = s_row(i + r);
        int64_t j = j0;
        for (; j + NA <= j1; j += NA) {
          const W* a[NA];
          for (int q = 0; q < NA; ++q) a[q] = group.a + (j + q) * in_features;
          dot_tile<NR, NA>(x, a, in_features, out, j);
        }
        for (; j < j1; ++j) {
          const W* const a[1] = {group.a + j * in_features};
          dot_tile<NR, 1>(x, a, in_features, out, j);
        }
      };
      int64_t i = 0;
      for (; i + kTileRows <= num_rows; i += kTileRows)
        shrink_rows(i, std::integral_constant<int, kTileRows>{},
                    std::integral_constant<int, kTileA>{});
      // The rows past the tiles (a decode's one row): 4 A rows per tile, 4 sums in flight.
      for (; i < num_rows; ++i)
        shrink_rows(i, std::integral_constant<int, 1>{}, std::integral_constant<int, 4>{});
    }
  });
  // The expand: each task a block of contiguous columns of one piece's B^T, for all the
  // group's rows, in register tiles of kExpandRows rows x 32 columns; then out += acc.
  pagedserve::parallel_for(0, static_cast<int64_t>(expand.size()), 1, [&](int64_t begin,
                                                                          int64_t end) {
    constexpr int64_t kTileColumns = 8 * kExpandVectors;
    alignas(32) float acc[kExpandRows][kExpandBlock];
    for (int64_t task = begin; task < end; ++task) {
      const auto [g, p, c0] = expand[task];
      const Group<W>& group = groups[g];
      const int64_t width = std::min(kExpandBlock, group.size[p] - c0);
      const int64_t num_rows = static_cast<int64_t>(group.rows.size());
      const W* b_block = group.b_t + group.b_col[p] + c0;
      auto s_row = [&](int64_t i) { return group.s.data() + i * group.stacked + p * group.rank; };
      // acc[r][0..width) for rows i..i+n: vector tiles, then the columns past them.
      auto expand_rows = [&](int64_t i, auto tile_rows) {
        constexpr int NR = decltype(tile_rows)::value;
        const float* s[NR];
        float* a[NR];
        for (int r = 0; r < NR; ++r) s[r] = s_row(i + r), a[r] = acc[r];
        int64_t c = 0;
        for (; c + kTileColumns <= width; c += kTileColumns) {
          float* at[NR];
          for (int r = 0; r < NR; ++r) at[r] = a[r] + c;
          expand_tile<NR, kExpandVectors>(s, b_block + c, group.columns, group.rank, at);
        }
        for (; c < width; ++c)
          for (int r = 0; r < NR; ++r)
            expand_column(s[r], b_block + c, group.columns, group.rank, a[r] + c);
        for (int r = 0; r < NR; ++r) {  // out += acc, rounded once
          T* out_row = op + group.rows[i + r] * out_stride + group.out_start[p] + c0;
          int64_t col = 0;
          for (; col + 8 <= width; col += 8) {
            const vec8 v = load8(a[r] + col) + load8(out_row + col);
            std::memcpy(a[r] + col, &v, sizeof v);
          }
          for (; col < width; ++col) a[r][col] += widen(out_row[col]);
          store_floats(a[r], out_row, width);
        }
      };
      int64_t i = 0;
      for (; i + kExpandRows <= num_rows; i += kExpandRows)
        expand_rows(i, std::integral_constant<int, kExpandRows>{});
      for (; i < num_rows; ++i) expand_rows(i, std::integral_constant<int, 1>{});
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
