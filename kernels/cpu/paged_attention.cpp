// Paged attention for the CPU: any number of query rows, each reading K and V straight
// from the head-major paged cache, so no per-step gather copy of the context.
//
//   out[b, h, :] = softmax(scale * q[b, h, :] . K[t, h / G, 0:len_b, :]) @ V[t, h / G, 0:len_b, :]
//
// where G = num_heads / num_kv_heads (grouped-query attention), t = row_tables[b] is the
// block-table row that query row b reads, and len_b = seq_lens[b] the number of keys it
// sees. Position p of that sequence lives in block block_table[t, p / block_size] at
// offset p % block_size:
//
//   kv_cache [2, num_kv_heads, num_blocks, block_size, head_size]   (0 = K, 1 = V)
//
// A decode is one row per request (row_tables = [0, 1, ..., B-1], len = the request's
// seq_len). A prompt chunk is one row per token, causal by its lengths. Example: a
// request in table row 3 with 7 cached tokens scheduling 2 more (positions 7 and 8):
//
//   rows  b = [.., 5, 6, ..]    row_tables = [.., 3, 3, ..]    seq_lens = [.., 8, 9, ..]
//
// Sliding window W > 0 (Mistral, Gemma 3's local layers): row b sees only its last W
// keys, positions [max(0, len_b - W), len_b); the blocks before the window's first one are
// never read (a sliding-window KV group may have freed them). Example, block_size 4,
// W 6, len 11: keys 5..10, blocks 1 and 2 (block 0 untouched), block 1 from offset 1.
//
// Work item = (query row, KV head): its G query heads share every K/V block read.
// Pass 1 writes the scaled scores of all positions, a softmax normalises them,
// pass 2 accumulates the weighted V rows. Query and output are float32; the cache may
// be float32, bfloat16 or float16 (widened to float32 as it is read). Head sizes
// 16/32/64/80/96/128/256; the torch path serves the rest.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "spin_pool.h"
#include "vec8.h"

namespace {

// Ask for the next block while this one is computed: blocks are scattered, so the
// hardware prefetcher cannot guess where the next 4 KiB (or so) come from.
template <typename T>
inline void prefetch_block(const T* block, int64_t num_values) {
  const char* bytes = reinterpret_cast<const char*>(block);
  for (int64_t i = 0; i < num_values * static_cast<int64_t>(sizeof(T)); i += 64)
    __builtin_prefetch(bytes + i);
}

template <typename T>  // the cache's element type
struct Problem {
  int64_t num_heads, num_kv_heads, num_blocks, block_size, group, table_stride;
  int64_t sliding_window;  // 0: every key
  float scale;
  const float* q_all;
  const T *k_cache, *v_cache;
  const int32_t *tables, *row_tables, *lens;  // row_tables null: row b reads table row b
  float* out_all;
};

// One (request, KV head): its `group` query heads against that head's context.
template <typename T, int kHeadSize>
void attend_one(const Problem<T>& pb, int64_t b, int64_t kv_head, std::vector<float>& scores) {
  constexpr int kVecs = kHeadSize / 8;
  const int64_t seq_len = pb.lens[b], group = pb.group, block_size = pb.block_size;
  // Keys [first, seq_len): all of them, or the last `sliding_window`.
  const int64_t first = pb.sliding_window > 0 ? std::max<int64_t>(0, seq_len - pb.sliding_window) : 0;
  const int64_t num_keys = seq_len - first;
  const int64_t block_floats = block_size * kHeadSize;
  const int64_t table_row = pb.row_tables ? pb.row_tables[b] : b;
  const int32_t* table = pb.tables + table_row * pb.table_stride;
  const float* q = pb.q_all + (b * pb.num_heads + kv_head * group) * kHeadSize;
  const int64_t head_base = kv_head * pb.num_blocks;
  const int64_t first_block = first / block_size;
  const int64_t end_block = (seq_len + block_size - 1) / block_size;
  scores.resize(group * num_keys);

  // Pass 1: scores[g * num_keys + p - first] = scale * q_g . k_p, four positions at a
  // time (four independent FMA chains instead of one).
  for (int64_t i = first_block; i < end_block; ++i) {
    const T* block_start = pb.k_cache + (head_base + table[i]) * block_floats;
    if (i + 1 < end_block) {
      prefetch_block(pb.k_cache + (head_base + table[i + 1]) * block_floats, block_floats);
    }
    // This block's keys: positions [lo, hi), offsets from lo - i * block_size.
    const int64_t lo = std::max(i * block_size, first);
    const int64_t count = std::min((i + 1) * block_size, seq_len) - lo;
    const T* k_block = block_start + (lo - i * block_size) * kHeadSize;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * kHeadSize;
      float* s = scores.data() + g * num_keys + (lo - first);
      int64_t t = 0;
      for (; t + 4 <= count; t += 4) {
        const T* k = k_block + t * kHeadSize;
        vec8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
        for (int j = 0; j < kVecs; ++j) {
          const vec8 qv = load8(qg + 8 * j);
          a0 += qv * load8(k + 8 * j);
          a1 += qv * load8(k + kHeadSize + 8 * j);
          a2 += qv * load8(k + 2 * kHeadSize + 8 * j);
          a3 += qv * load8(k + 3 * kHeadSize + 8 * j);
        }
        s[t] = pb.scale * sum8(a0);
        s[t + 1] = pb.scale * sum8(a1);
        s[t + 2] = pb.scale * sum8(a2);
        s[t + 3] = pb.scale * sum8(a3);
      }
      for (; t < count; ++t) {
        vec8 a = {};
        for (int j = 0; j < kVecs; ++j) a += load8(qg + 8 * j) * load8(k_block + t * kHeadSize + 8 * j);
        s[t] = pb.scale * sum8(a);
      }
    }
  }

  // Softmax over positions, per query head; then pass 2, per query head, with its
  // output row held in registers: out_g = sum_p softmax_p * v_p.
  float* out = pb.out_all + (b * pb.num_heads + kv_head * group) * kHeadSize;
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * num_keys;
    const float max_score = *std::max_element(s, s + num_keys);
    float sum = 0.f;
    for (int64_t p = 0; p < num_keys; ++p) {
      s[p] = std::exp(s[p] - max_score);
      sum += s[p];
    }
    vec8 acc[kVecs] = {};
    for (int64_t i = first_block; i < end_block; ++i) {
      const T* block_start = pb.v_cache + (head_base + table[i]) * block_floats;
      if (g == 0 && i + 1 < end_block) {
        prefetch_block(pb.v_cache + (head_base + table[i + 1]) * block_floats, block_floats);
      }
      const int64_t lo = std::max(i * block_size, first);
      const int64_t count = std::min((i + 1) * block_size, seq_len) - lo;
      const T* v_block = block_start + (lo - i * block_size) * kHeadSize;
      const float* weights = s + (lo - first);
      for (int64_t t = 0; t < count; ++t) {
        const float weight = weights[t];
        const T* v = v_block + t * kHeadSize;
        for (int j = 0; j < kVecs; ++j) acc[j] += weight * load8(v + 8 * j);
      }
    }
    const float inv_sum = 1.f / sum;
    for (int j = 0; j < kVecs; ++j) {
      const vec8 o = acc[j] * inv_sum;
      std::memcpy(out + g * kHeadSize + 8 * j, &o, sizeof o);
    }
  }
}

// Rows in zigzag order, so that each thread's contiguous share of the items mixes short
// and long rows (a prompt's rows grow by one key each: a plain split would give the
// second thread three quarters of the work). Example, 6 rows: 0 5 1 4 2 3.
inline int64_t zigzag(int64_t k, int64_t n) { return k % 2 == 0 ? k / 2 : n - 1 - k / 2; }

template <typename T, int kHeadSize>
void attend_all(const Problem<T>& pb, int64_t num_rows) {
  pagedserve::parallel_for(0, num_rows * pb.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = zigzag(item / pb.num_kv_heads, num_rows);
      attend_one<T, kHeadSize>(pb, row, item % pb.num_kv_heads, scores);
    }
  });
}


template <typename T>
void run(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
         const at::Tensor& block_table, const at::Tensor& row_tables,
         const at::Tensor& seq_lens, double scale, int64_t sliding_window) {
  const int64_t num_rows = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2);
  Problem<T> pb;
  pb.num_heads = num_heads;
  pb.num_kv_heads = num_kv_heads;
  pb.num_blocks = num_blocks;
  pb.block_size = kv_cache.size(3);
  pb.group = num_heads / num_kv_heads;
  pb.table_stride = block_table.stride(0);
  pb.sliding_window = sliding_window;
  pb.scale = static_cast<float>(scale);
  pb.q_all = query.data_ptr<float>();
  pb.out_all = out.data_ptr<float>();
  pb.k_cache = kv_cache.data_ptr<T>();
  pb.v_cache = pb.k_cache + num_kv_heads * num_blocks * pb.block_size * head_size;
  pb.tables = block_table.data_ptr<int32_t>();
  pb.row_tables = row_tables.numel() ? row_tables.data_ptr<int32_t>() : nullptr;
  pb.lens = seq_lens.data_ptr<int32_t>();
  // Validate every index the kernel will follow, before any thread starts.
  const int64_t max_blocks = block_table.size(1), num_tables = block_table.size(0);
  for (int64_t b = 0; b < num_rows; ++b) {
    const int64_t len = pb.lens[b];
    const int64_t table_row = pb.row_tables ? pb.row_tables[b] : b;
    TORCH_CHECK(table_row >= 0 && table_row < num_tables, "row_tables entry out of range");
    TORCH_CHECK(len >= 1 && (len + pb.block_size - 1) / pb.block_size <= max_blocks,
                "seq_len out of range for its block table row");
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    for (int64_t i = first / pb.block_size; i < (len + pb.block_size - 1) / pb.block_size; ++i) {
      const int64_t block = pb.tables[table_row * pb.table_stride + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range");
    }
  }
  switch (head_size) {
    case 16: attend_all<T, 16>(pb, num_rows); break;
    case 32: attend_all<T, 32>(pb, num_rows); break;
    case 64: attend_all<T, 64>(pb, num_rows); break;
    case 80: attend_all<T, 80>(pb, num_rows); break;
    case 96: attend_all<T, 96>(pb, num_rows); break;
    case 128: attend_all<T, 128>(pb, num_rows); break;
    case 256: attend_all<T, 256>(pb, num_rows); break;
    default: TORCH_CHECK(false, "head_size ", head_size, " not supported (16/32/64/80/96/128/256)");
  }
}

}  // namespace

void paged_attention(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                     at::Tensor block_table, at::Tensor row_tables, at::Tensor seq_lens,
                     double scale, int64_t sliding_window) {
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none)");
  TORCH_CHECK(query.scalar_type() == at::kFloat, "paged_attention: float32 query");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be contiguous [B, Hq, D]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() &&
                  out.scalar_type() == at::kFloat, "out must be like query");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, Hkv, num_blocks, block_size, D]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.stride(1) == 1, "block_table must be int32 [R, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.size(0) == query.size(0), "seq_lens must be contiguous int32 [B]");
  TORCH_CHECK(kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(1) == 0,
              "query and kv_cache heads do not match");
  if (row_tables.numel()) {
    TORCH_CHECK(row_tables.scalar_type() == at::kInt && row_tables.is_contiguous() &&
                    row_tables.size(0) == query.size(0),
                "row_tables must be contiguous int32 [B] (or empty: row b reads table row b)");
  } else {
    TORCH_CHECK(block_table.size(0) == query.size(0),
                "without row_tables, one block_table row per query row");
  }
  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      run<float>(out, query, kv_cache, block_table, row_tables, seq_lens, scale, sliding_window);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(out, query, kv_cache, block_table, row_tables, seq_lens, scale, sliding_window);
      break;
    case at::kHalf:
      run<c10::Half>(out, query, kv_cache, block_table, row_tables, seq_lens, scale, sliding_window);
      break;
    default: TORCH_CHECK(false, "paged_attention: float32, bfloat16 or float16 cache");
  }
}
