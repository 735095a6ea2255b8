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
// Work item = (run, KV head), a run being up to 8 consecutive rows that read the same
// table row (a prompt chunk, or a speculative step's 1 + k rows: 8 rows of SmolLM2's
// 3 query heads per KV head are 24 query vectors against every K/V block read once).
// Pass 1 writes the scaled scores of all positions, a softmax turns them into weights,
// pass 2 accumulates the weighted V rows. Each output value takes the same operations
// in the same order whatever the other rows of its run, so the kernel is batch
// invariant: a row's result is the same to the bit alone, in a run or in any batch.
// Query and output are float32 (or bfloat16 / float16, widened and rounded around the float32
// work); the cache may be float32, bfloat16 or float16 (widened
// to float32 as it is read), or int8 (engine/attention/kv_int8.py: each token's row of a
// head is head_size int8 values and their float32 scale, head_size + 4 bytes; keys are
// widened and scaled into float32 as they are read, a value row's scale multiplies its
// weight). Head sizes 16/32/64/80/96/128/256; the torch path serves the rest.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "exp_poly.h"
#include "float_rows.h"
#include "kv_int8_rows.h"
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

// e^x for x <= 0, lane by lane (x below -87.3 gives 0): x = n ln 2 + r, |r| <= ln 2 / 2,
// e^r by a degree-6 polynomial, 2^n put in the exponent bits. The same instructions for
// every lane, so a score's weight does not depend on the lanes beside it.
inline vec8 exp8(vec8 x) {
  typedef int32_t ivec8 __attribute__((vector_size(32)));
  const vec8 lowest = vec8{} - 87.3f;
  x = x < lowest ? lowest : x;
  using namespace pagedserve::exp_poly;
  const vec8 scaled = x * kLog2E + 0.5f;
  ivec8 n = __builtin_convertvector(scaled, ivec8);       // truncates toward zero:
  n += (__builtin_convertvector(n, vec8) > scaled);       // -1 where that was not the floor
  const vec8 nf = __builtin_convertvector(n, vec8);
  const vec8 r = x - nf * kLn2High - nf * kLn2Low;
  vec8 p = r * kE6 + kE5;
  p = p * r + kE4;
  p = p * r + kE3;
  p = p * r + kE2;
  p = p * r + kE1;
  p = p * (r * r) + r + 1.f;
  vec8 two_n;
  const ivec8 bits = (n + 127) << 23;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

constexpr vec8 kLaneIndex = {0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f};

// The sums of eight vectors, out[i] = sum8(v[i]) to the bit: the same pairs added in
// the same order ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), eight at a time.
inline vec8 sums8(const vec8 v[8]) {
#if defined(__AVX__)
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
  const __m256 ab = _mm256_hadd_ps((__m256)v[0], (__m256)v[1]);
  const __m256 cd = _mm256_hadd_ps((__m256)v[2], (__m256)v[3]);
  const __m256 ef = _mm256_hadd_ps((__m256)v[4], (__m256)v[5]);
  const __m256 gh = _mm256_hadd_ps((__m256)v[6], (__m256)v[7]);
  // [A_lo, B_lo, C_lo, D_lo | A_hi, ...] with A_lo = (a0+a1)+(a2+a3), A_hi = (a4+a5)+(a6+a7)
  const __m256 abcd = _mm256_hadd_ps(ab, cd), efgh = _mm256_hadd_ps(ef, gh);
  return (vec8)_mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20),
                             _mm256_permute2f128_ps(abcd, efgh, 0x31));
#else
  vec8 out;
  for (int i = 0; i < 8; ++i) out[i] = sum8(v[i]);
  return out;
#endif
}

using pagedserve::kv_int8::row_scale;

// Elements of one (token, head) row of the cache: head_size, plus an int8 row's scale.
template <typename T>
constexpr int64_t row_elements(int64_t head_size) {
  return std::is_same<T, int8_t>::value ? head_size + pagedserve::kv_int8::kScaleBytes
                                        : head_size;
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

  int64_t table_row(int64_t b) const { return row_tables ? row_tables[b] : b; }
  // Keys [first_key(b), lens[b]): all of them, or the last `sliding_window`.
  int64_t first_key(int64_t b) const {
    return sliding_window > 0 ? std::max<int64_t>(0, lens[b] - sliding_window) : 0;
  }
};

// A run: consecutive query rows [row0, row0 + num_rows) that read the same block-table
// row (a prompt chunk's rows, a speculative step's 1 + k rows, or one decode row), so
// that each K/V block it reads serves all of their query heads at once.
struct Run {
  int64_t row0, num_rows;
};

// The most V bytes a run prefetches during pass 1: its V and the K read beside it each
// take a quarter of the smallest L2 seen (a Zen 2/3 core's 512 KiB). Example: 512 keys
// of a float32 head of 64 (256 bytes a row).
constexpr int64_t kPrefetchValueBytes = 128 * 1024;

// Per-thread work space of `attend_run`.
struct Scratch {
  std::vector<float> scores;  // [M, stride]: scores, then softmax weights
  std::vector<float> block;   // one K block widened to float32 (bfloat16/float16 caches)
  std::vector<float> inv_sums;
  // Per query vector m: its query, its row of `scores`, its output.
  std::vector<const float*> queries;
  std::vector<float*> score_rows, outs;
};

// Scores of P keys x Q query vectors (P Q = 8, or anything with the plain sums):
// s[p][q] = scale * sum8(sum_j q_j * k_j), each an FMA chain over the head's eight-float
// slices j then the fixed pairwise sum, so a score's bits do not depend on which
// micro-kernel (or how many rows beside it) computed it.
template <int kHeadSize, int P, int Q>
inline void score_tile(const float* const* qs, const float* k, float scale, float* const* out,
                       int64_t key_offset) {
  constexpr int kVecs = kHeadSize / 8;
  vec8 acc[P * Q] = {};
  for (int j = 0; j < kVecs; ++j) {
    vec8 qv[Q];
    for (int q = 0; q < Q; ++q) qv[q] = load8(qs[q] + 8 * j);
    for (int p = 0; p < P; ++p) {
      const vec8 kv = load8(k + p * kHeadSize + 8 * j);
      for (int q = 0; q < Q; ++q) acc[q * P + p] += qv[q] * kv;
    }
  }
  if constexpr (P * Q == 8) {
    const vec8 s = sums8(acc) * scale;  // lane q P + p = key p, query q
    for (int q = 0; q < Q; ++q)
      for (int p = 0; p < P; ++p) out[q][key_offset + p] = s[q * P + p];
  } else {
    for (int q = 0; q < Q; ++q)
      for (int p = 0; p < P; ++p) out[q][key_offset + p] = scale * sum8(acc[q * P + p]);
  }
}

// Query vectors per pass-2 tile: 4 x 4 accumulators of eight floats, plus the V slices,
// fit AVX-512's 32 vector registers; AVX2 has 16, so 2 x 4 there.
#if defined(__AVX512VL__)
constexpr int64_t kValueTileVectors = 4;
#else
constexpr int64_t kValueTileVectors = 2;
#endif

// out_m += sum_p w_m[p] v_p over keys [lo, hi) of one V block, for M (<= 4) query
// vectors and J eight-float slices starting at slice j0: one FMA chain per output value
// in key order (a zero weight leaves the chain's value unchanged).
template <typename T, int kHeadSize, int M, int J>
inline void weigh_values(const T* v_block, int64_t count, const float* const* weights,
                         int64_t j0, vec8 (&acc)[M][J]) {
  constexpr int64_t kRow = row_elements<T>(kHeadSize);
  for (int64_t t = 0; t < count; ++t) {
    const T* v = v_block + t * kRow + 8 * j0;
    vec8 vv[J];
    for (int j = 0; j < J; ++j) vv[j] = load8(v + 8 * j);
    float row_weight = 1.f;  // an int8 row's scale, folded into each weight
    if constexpr (std::is_same<T, int8_t>::value) row_weight = row_scale(v_block + t * kRow, kHeadSize);
    for (int m = 0; m < M; ++m) {
      const float w = weights[m][t] * row_weight;
      for (int j = 0; j < J; ++j) acc[m][j] += w * vv[j];
    }
  }
}

// out_m = w_m . V / sum(w_m) for query vectors [m0, m0 + M) over keys [first, end):
// the blocks of V one after another, each output slice's chains held in registers.
template <typename T, int kHeadSize, int M, int J>
void weigh_all(const Problem<T>& pb, const int32_t* table, int64_t head_base, int64_t first,
               int64_t end, int64_t run_first, float* const* weights_of_m, int64_t j0,
               float* const* outs, const float* inv_sums) {
  constexpr int64_t kRow = row_elements<T>(kHeadSize);
  const int64_t block_size = pb.block_size, block_elems = block_size * kRow;
  vec8 acc[M][J] = {};
  const float* weights[M];
  for (int64_t i = first / block_size; i < (end + block_size - 1) / block_size; ++i) {
    const T* block_start = pb.v_cache + (head_base + table[i]) * block_elems;
    const int64_t lo = std::max(i * block_size, first);
    const int64_t count = std::min((i + 1) * block_size, end) - lo;
    for (int m = 0; m < M; ++m) weights[m] = weights_of_m[m] + (lo - run_first);
    weigh_values<T, kHeadSize, M, J>(block_start + (lo - i * block_size) * kRow, count,
                                     weights, j0, acc);
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) {
      const vec8 o = acc[m][j] * inv_sums[m];
      std::memcpy(outs[m] + 8 * (j0 + j), &o, sizeof o);
    }
}

// One (run, KV head): the run's rows x the head's `group` query heads = M query vectors,
// m = r * group + g, against the keys [first, end) that any of its rows sees.
//   pass 1: scores[m][p - first] = scale * q_m . k_p for every key of the run
//   softmax: row r's weights over its own keys [first_r, len_r), zero elsewhere
//   pass 2: out_m = sum_p weights[m][p] v_p / sum_p weights[m][p]
// Every output value is computed by the same operations in the same order whatever the
// run's other rows, so a row's result is the same to the bit alone or in any run.
template <typename T, int kHeadSize>
void attend_run(const Problem<T>& pb, const Run& run, int64_t kv_head, Scratch& scratch) {
  constexpr int kVecs = kHeadSize / 8;
  const int64_t group = pb.group, block_size = pb.block_size;
  const int64_t num_vectors = run.num_rows * group;
  int64_t first = pb.first_key(run.row0), end = pb.lens[run.row0];
  for (int64_t r = 1; r < run.num_rows; ++r) {
    first = std::min(first, pb.first_key(run.row0 + r));
    end = std::max(end, static_cast<int64_t>(pb.lens[run.row0 + r]));
  }
  constexpr int64_t kRow = row_elements<T>(kHeadSize);
  const int64_t block_floats = block_size * kHeadSize, block_elems = block_size * kRow;
  const int32_t* table = pb.tables + pb.table_row(run.row0) * pb.table_stride;
  const int64_t head_base = kv_head * pb.num_blocks;
  // Room for a row's last chunk of eight weights past `end` (see the softmax).
  const int64_t stride = (end - first + 7) / 8 * 8 + 8;
  scratch.scores.resize(num_vectors * stride);
  scratch.inv_sums.resize(num_vectors);
  std::vector<const float*>& queries = scratch.queries;
  std::vector<float*>& scores = scratch.score_rows;
  std::vector<float*>& outs = scratch.outs;
  queries.resize(num_vectors);
  scores.resize(num_vectors);
  outs.resize(num_vectors);
  for (int64_t m = 0; m < num_vectors; ++m) {
    const int64_t head = (run.row0 + m / group) * pb.num_heads + kv_head * group + m % group;
    queries[m] = pb.q_all + head * kHeadSize;
    outs[m] = pb.out_all + head * kHeadSize;
    scores[m] = scratch.scores.data() + m * stride;
  }

  // Pass 1, a block of keys at a time: 4 keys x 2 query vectors per tile (8 keys x 1
  // for an odd one out), single keys at the block's end. While a K block is scored, the
  // next K block is fetched, and this block's V too where the run's V fits the core's
  // cache until pass 2 reads it (a decode's K/V comes from memory: the weights streamed
  // since the last step evicted it; pass 2 waited on each V block). A longer context's
  // V would be evicted again before pass 2 and read twice.
  const bool prefetch_values =
      (end - first) * kRow * static_cast<int64_t>(sizeof(T)) <= kPrefetchValueBytes;
  if (!std::is_same<T, float>::value) scratch.block.resize(block_floats);
  for (int64_t i = first / block_size; i < (end + block_size - 1) / block_size; ++i) {
    const T* block_start = pb.k_cache + (head_base + table[i]) * block_elems;
    if ((i + 1) * block_size < end) {
      prefetch_block(pb.k_cache + (head_base + table[i + 1]) * block_elems, block_elems);
    }
    if (prefetch_values)
      prefetch_block(pb.v_cache + (head_base + table[i]) * block_elems, block_elems);
    const int64_t lo = std::max(i * block_size, first);
    const int64_t count = std::min((i + 1) * block_size, end) - lo;
    const float* keys;
    if constexpr (std::is_same<T, float>::value) {
      keys = block_start + (lo - i * block_size) * kHeadSize;
    } else if constexpr (std::is_same<T, int8_t>::value) {
      // Each key row widened and times its scale, once for all M query vectors.
      for (int64_t t = 0; t < count; ++t) {
        const int8_t* k = block_start + (lo - i * block_size + t) * kRow;
        const vec8 scale = broadcast8(row_scale(k, kHeadSize));
        for (int64_t x = 0; x < kHeadSize; x += 8) {
          const vec8 wide = load8(k + x) * scale;
          std::memcpy(scratch.block.data() + t * kHeadSize + x, &wide, sizeof wide);
        }
      }
      keys = scratch.block.data();
    } else {  // widen the block's keys once for all M query vectors (exact)
      const T* k = block_start + (lo - i * block_size) * kHeadSize;
      for (int64_t x = 0; x < count * kHeadSize; x += 8) {
        const vec8 wide = load8(k + x);
        std::memcpy(scratch.block.data() + x, &wide, sizeof wide);
      }
      keys = scratch.block.data();
    }
    const int64_t at = lo - first;
    int64_t m = 0;
    for (; m + 2 <= num_vectors; m += 2) {
      int64_t t = 0;
      for (; t + 4 <= count; t += 4)
        score_tile<kHeadSize, 4, 2>(&queries[m], keys + t * kHeadSize, pb.scale, &scores[m], at + t);
      for (; t < count; ++t)
        score_tile<kHeadSize, 1, 2>(&queries[m], keys + t * kHeadSize, pb.scale, &scores[m], at + t);
    }
    if (m < num_vectors) {
      int64_t t = 0;
      for (; t + 8 <= count; t += 8)
        score_tile<kHeadSize, 8, 1>(&queries[m], keys + t * kHeadSize, pb.scale, &scores[m], at + t);
      for (; t < count; ++t)
        score_tile<kHeadSize, 1, 1>(&queries[m], keys + t * kHeadSize, pb.scale, &scores[m], at + t);
    }
  }

  // Softmax of each query vector over its row's keys, eight at a time from the row's
  // first key; the lanes past its last key (other rows' keys, or the padding) and the
  // keys before its first get weight 0. The sum: lane l adds weights l, l + 8, ...,
  // then the fixed pairwise sum of the lanes.
  for (int64_t m = 0; m < num_vectors; ++m) {
    const int64_t row = run.row0 + m / group;
    const int64_t own_first = pb.first_key(row) - first, own_end = pb.lens[row] - first;
    float* s = scores[m];
    // The maximum, eight lanes at a time (the same value in any order).
    vec8 lane_max = vec8{} + s[own_first];
    int64_t p = own_first;
    for (; p + 8 <= own_end; p += 8) {
      const vec8 x = load8(s + p);
      lane_max = x > lane_max ? x : lane_max;
    }
    float max_score = lane_max[0];
    for (int l = 1; l < 8; ++l) max_score = std::max(max_score, lane_max[l]);
    for (; p < own_end; ++p) max_score = std::max(max_score, s[p]);
    std::fill(s, s + own_first, 0.f);
    vec8 lane_sums = {};
    for (p = own_first; p < own_end; p += 8) {
      vec8 w = exp8(load8(s + p) - max_score);
      w = kLaneIndex < static_cast<float>(own_end - p) ? w : vec8{};  // past the row's keys
      std::memcpy(s + p, &w, sizeof w);
      lane_sums += w;
    }
    std::fill(s + own_end, s + std::max(own_end, end - first), 0.f);  // later rows' keys
    scratch.inv_sums[m] = 1.f / sum8(lane_sums);
  }

  // Pass 2, kValueTileVectors query vectors x 32 output values at a time, over the keys
  // any of those vectors' rows sees.
  for (int64_t m0 = 0; m0 < num_vectors; m0 += kValueTileVectors) {
    const int64_t count = std::min<int64_t>(kValueTileVectors, num_vectors - m0);
    int64_t lo = pb.first_key(run.row0 + m0 / group), hi = pb.lens[run.row0 + m0 / group];
    for (int64_t m = m0 + 1; m < m0 + count; ++m) {
      lo = std::min(lo, pb.first_key(run.row0 + m / group));
      hi = std::max(hi, static_cast<int64_t>(pb.lens[run.row0 + m / group]));
    }
    float* const* w = &scores[m0];
    float* const* o = &outs[m0];
    const float* inv = scratch.inv_sums.data() + m0;
    for (int64_t j0 = 0; j0 < kVecs; j0 += 4) {
      const bool two = kVecs - j0 < 4;  // head sizes 16 and 80 end with 2 slices
#define PAGEDSERVE_WEIGH(M)                                                                  \
  (two ? weigh_all<T, kHeadSize, M, 2>(pb, table, head_base, lo, hi, first, w, j0, o, inv)    \
       : weigh_all<T, kHeadSize, M, 4>(pb, table, head_base, lo, hi, first, w, j0, o, inv))
      switch (count) {
        case 1: PAGEDSERVE_WEIGH(1); break;
#if defined(__AVX512VL__)
        case 2: PAGEDSERVE_WEIGH(2); break;
        case 3: PAGEDSERVE_WEIGH(3); break;
        default: PAGEDSERVE_WEIGH(4); break;
#else
        default: PAGEDSERVE_WEIGH(2); break;
#endif
      }
#undef PAGEDSERVE_WEIGH
    }
  }
}

// Runs of consecutive rows with the same table row, cut to at most `max_rows` rows.
// Example, row_tables [0, 1, 1, 1, 1, 1, 2] with max_rows 4: rows {0}, {1..4}, {5}, {6}.
template <typename T>
std::vector<Run> cut_runs(const Problem<T>& pb, int64_t num_rows, int64_t max_rows) {
  std::vector<Run> runs;
  for (int64_t b = 0; b < num_rows; ++b) {
    if (!runs.empty() && runs.back().num_rows < max_rows &&
        pb.table_row(runs.back().row0) == pb.table_row(b)) {
      ++runs.back().num_rows;
    } else {
      runs.push_back(Run{b, 1});
    }
  }
  return runs;
}

// Runs in zigzag order, so that each thread's contiguous share of the items mixes short
// and long runs (a prompt's rows grow by one key each: a plain split would give the
// second thread three quarters of the work). Example, 6 runs: 0 5 1 4 2 3.
inline int64_t zigzag(int64_t k, int64_t n) { return k % 2 == 0 ? k / 2 : n - 1 - k / 2; }

constexpr int64_t kMaxRunRows = 8;

template <typename T, int kHeadSize>
void attend_all(const Problem<T>& pb, int64_t num_rows) {
  // Longer runs share more of each block read; shorter ones leave every thread some
  // items (8 verify rows x 3 KV heads on 2 threads: runs of 4 rows, 6 items).
  const int64_t threads = at::get_num_threads();
  int64_t max_rows = kMaxRunRows;
  std::vector<Run> runs = cut_runs(pb, num_rows, max_rows);
  while (max_rows > 1 && static_cast<int64_t>(runs.size()) * pb.num_kv_heads < 2 * threads) {
    max_rows = (max_rows + 1) / 2;
    runs = cut_runs(pb, num_rows, max_rows);
  }
  const int64_t num_runs = runs.size();
  pagedserve::parallel_for(0, num_runs * pb.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const Run& run = runs[zigzag(item / pb.num_kv_heads, num_runs)];
      attend_run<T, kHeadSize>(pb, run, item % pb.num_kv_heads, scratch);
    }
  });
}


template <typename T>
void run(float* out, const float* query_values, const at::Tensor& query,
         const at::Tensor& kv_cache, const at::Tensor& block_table,
         const at::Tensor& row_tables, const at::Tensor& seq_lens, double scale,
         int64_t sliding_window) {
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
  pb.q_all = query_values;
  pb.out_all = out;
  pb.k_cache = kv_cache.data_ptr<T>();
  pb.v_cache = pb.k_cache + num_kv_heads * num_blocks * pb.block_size * kv_cache.size(4);
  pb.tables = block_table.data_ptr<int32_t>();
  pb.row_tables = row_tables.numel() ? row_tables.data_ptr<int32_t>() : nullptr;
  pb.lens = seq_lens.data_ptr<int32_t>();
  // Validate every index the kernel will follow, before any thread starts.
  const int64_t max_blocks = block_table.size(1), num_tables = block_table.size(0);
  for (int64_t b = 0; b < num_rows; ++b) {
    const int64_t len = pb.lens[b];
    const int64_t table_row = pb.table_row(b);
    TORCH_CHECK(table_row >= 0 && table_row < num_tables, "row_tables entry out of range");
    TORCH_CHECK(len >= 1 && (len + pb.block_size - 1) / pb.block_size <= max_blocks,
                "seq_len out of range for its block table row");
    for (int64_t i = pb.first_key(b) / pb.block_size; i < (len + pb.block_size - 1) / pb.block_size; ++i) {
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
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK(pagedserve::float_dtype(dtype), "paged_attention: float32, bfloat16 or float16 query");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be contiguous [B, Hq, D]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() &&
                  out.scalar_type() == dtype, "out must be like query");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, Hkv, num_blocks, block_size, D]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.stride(1) == 1, "block_table must be int32 [R, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.size(0) == query.size(0), "seq_lens must be contiguous int32 [B]");
  const int64_t row = kv_cache.size(4) - (kv_cache.scalar_type() == at::kChar
                                              ? pagedserve::kv_int8::kScaleBytes : 0);
  TORCH_CHECK(row == query.size(2) && query.size(1) % kv_cache.size(1) == 0,
              "query and kv_cache heads do not match (an int8 cache's rows hold head_size + 4)");
  if (row_tables.numel()) {
    TORCH_CHECK(row_tables.scalar_type() == at::kInt && row_tables.is_contiguous() &&
                    row_tables.size(0) == query.size(0),
                "row_tables must be contiguous int32 [B] (or empty: row b reads table row b)");
  } else {
    TORCH_CHECK(block_table.size(0) == query.size(0),
                "without row_tables, one block_table row per query row");
  }
  // The kernel works in float32: a bfloat16 / float16 query is widened (exact) and the
  // rows rounded into out at the end, as Tensor.to around a float32 call would.
  std::vector<float> query_floats, out_floats(dtype == at::kFloat ? 0 : out.numel());
  const float* q = pagedserve::float_values(query, query_floats);
  float* o = dtype == at::kFloat ? out.data_ptr<float>() : out_floats.data();
  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      run<float>(o, q, query, kv_cache, block_table, row_tables, seq_lens, scale, sliding_window);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(o, q, query, kv_cache, block_table, row_tables, seq_lens, scale,
                         sliding_window);
      break;
    case at::kHalf:
      run<c10::Half>(o, q, query, kv_cache, block_table, row_tables, seq_lens, scale,
                     sliding_window);
      break;
    case at::kChar:
      run<int8_t>(o, q, query, kv_cache, block_table, row_tables, seq_lens, scale, sliding_window);
      break;
    default: TORCH_CHECK(false, "paged_attention: float32, bfloat16, float16 or int8 cache");
  }
  pagedserve::round_into(o, out, 0, out.numel());
}
