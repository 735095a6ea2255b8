// Causal attention of a long bfloat16 prompt chunk with AVX512-BF16 dot products, for the
// chunks the paged kernel leaves to SDPA (more than KERNEL_MAX_CHUNK tokens).
//
//   out[i, h, :] = softmax(scale * q[i, h, :] . K[h / G, 0 : S - L + i + 1, :])
//                  @ V[h / G, 0 : S - L + i + 1, :]
//
// q, out [L, Hq, D]: the chunk's L query tokens, the LAST L of the S positions that
// k, v [Hkv, S, D] hold (query i sits at position S - L + i); G = Hq / Hkv. Example,
// S = 5, L = 2: query 0 sees keys 0..3, query 1 keys 0..4.
//
// Why: torch's CPU flash kernel widens bfloat16 to float32 and runs float32 GEMMs
// (~110-160 GFLOP/s on a Zen 5 pair, where bf16 matmuls reach ~890), so a 3,800-token
// prompt of a 1B Llama spent about half its prefill in attention. `vdpbf16ps` multiplies
// 32 bf16 pairs into 16 float32 sums per instruction.
//
// The scheme (FlashAttention's online softmax over blocks of 32 keys):
// 1. Pack each KV head's keys and values once into the pair layouts vdpbf16ps reads
//    (zero past S):
//      kp[h][block][p][j]  = (k[32 block + j][2p], k[32 block + j][2p + 1])   a key pair of dims
//      vp[h][block][jp][d] = (v[32 block + 2jp][d], v[32 block + 2jp + 1][d]) a dim of two keys
//    each a uint32 holding two bf16 (the lower half the first).
// 2. Work item = (KV head, 32 consecutive query positions): its G x 32 query vectors
//    ("rows", position-major: row r is position r / G of the item, query head
//    h G + r % G) read each K/V block once. For each block, rows go 8 at a time:
//      scores  s[r][j] = scale * q_r . k_j  (8 rows x 32 keys in 16 registers, lanes = keys)
//      softmax m' = max(m, max_j s), c = e^(m - m'), p = e^(s - m'), l = l c + sum p
//      values  o_r = o_r c + sum_j p[r][j] v_j   (p rounded to bf16; lanes = dims)
//    then out = o / l, rounded to bf16. Keys past a row's position are masked out.
// 3. Items are claimed largest first (the last positions see the most keys), so the two
//    threads finish together.
//
// Accuracy: products of bf16 inputs summed in float32, as torch's kernel; the weights p
// are rounded to bf16 before the value sums (torch keeps them in float32), which moves
// an output by about one bf16 step. Head sizes: multiples of 32 up to 256.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "exp_poly.h"
#include "spin_pool.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_PREFILL_BF16 1
#endif

bool prefill_attention_available() {
#ifdef PAGEDSERVE_PREFILL_BF16
  return true;
#else
  return false;
#endif
}

#ifdef PAGEDSERVE_PREFILL_BF16
namespace {

constexpr int kBlockKeys = 32;   // keys per block: two 16-lane score vectors
constexpr int kItemPositions = 32;  // query positions per work item
constexpr int kTileRows = 8;     // score rows per register tile

// e^x lane by lane; 0 where x < -87 (so a masked -inf score weighs exactly 0):
// x = n ln 2 + r, e^r by exp_poly.h's polynomial, times 2^n.
inline __m512 exp512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  using namespace pagedserve::exp_poly;
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(kE6), _mm512_set1_ps(kE5));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kE4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kE3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kE2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kE1));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

inline __m512bh pair_broadcast(uint32_t pair) {
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}

struct Shapes {
  int64_t L, S, Hkv, G, D, blocks;
  int64_t q_token_stride, q_head_stride, out_token_stride, out_head_stride;
  int64_t k_head_stride, k_token_stride, v_head_stride, v_token_stride;
  float scale;
};

// Step 1 for one (KV head, key block): the pair layouts above, zeros past S.
void pack_block(const Shapes& s, const uint16_t* k, const uint16_t* v, int64_t head,
                int64_t block, uint32_t* kp, uint32_t* vp) {
  const int64_t half = s.D / 2;
  const uint16_t zeros[256] = {};
  const uint16_t* krows[kBlockKeys];
  const uint16_t* vrows[kBlockKeys];
  for (int j = 0; j < kBlockKeys; ++j) {
    const int64_t key = block * kBlockKeys + j;
    krows[j] = key < s.S ? k + head * s.k_head_stride + key * s.k_token_stride : zeros;
    vrows[j] = key < s.S ? v + head * s.v_head_stride + key * s.v_token_stride : zeros;
  }
  for (int64_t p = 0; p < half; ++p)
    for (int j = 0; j < kBlockKeys; ++j) {
      uint32_t pair;
      std::memcpy(&pair, krows[j] + 2 * p, sizeof pair);
      kp[p * kBlockKeys + j] = pair;
    }
  for (int jp = 0; jp < kBlockKeys / 2; ++jp)
    for (int64_t d = 0; d < s.D; ++d)
      vp[jp * s.D + d] = static_cast<uint32_t>(vrows[2 * jp][d]) |
                         (static_cast<uint32_t>(vrows[2 * jp + 1][d]) << 16);
}

// One work item's running state: per row its output sums (float32 [rows, D]), running
// max m and sum l, the last block's correction e^(m_old - m), its query and position.
struct ItemState {
  std::vector<float> o, m, l, correction;
  std::vector<const uint32_t*> q;  // the row's query as bf16 pairs
  std::vector<int64_t> position;   // the row's position among the S keys
  std::vector<uint16_t> weights;   // a tile's bf16 weights [kTileRows][kBlockKeys]
};

// Step 2 for one tile of kTileRows rows against one key block: scores, the online
// softmax update, the weighted value sums. `masked`: some key of the block lies past
// some row's position or past S.
template <int D>
void tile_block(const Shapes& s, ItemState& st, int64_t row0, int64_t block, bool masked,
                const uint32_t* kp, const uint32_t* vp) {
  __m512 acc[kTileRows][2];
  for (int r = 0; r < kTileRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint32_t* const* q = st.q.data() + row0;
#pragma GCC unroll 2
  for (int p = 0; p < D / 2; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * kBlockKeys);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + p * kBlockKeys + 16);
    for (int r = 0; r < kTileRows; ++r) {
      const __m512bh qr = pair_broadcast(q[r][p]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, qr);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, qr);
    }
  }
  const __m512 scale = _mm512_set1_ps(s.scale);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int64_t first_key = block * kBlockKeys;
  for (int r = 0; r < kTileRows; ++r) {
    const int64_t row = row0 + r;
    __m512 s0 = _mm512_mul_ps(acc[r][0], scale), s1 = _mm512_mul_ps(acc[r][1], scale);
    if (masked) {  // keys first_key + lane; visible while <= the row's position
      const int64_t last_visible = std::min(st.position[row], s.S - 1) - first_key;
      const __m512i limit = _mm512_set1_epi32(static_cast<int>(std::max<int64_t>(last_visible, -1)));
      s0 = _mm512_mask_mov_ps(minus_inf, _mm512_cmple_epi32_mask(lanes, limit), s0);
      s1 = _mm512_mask_mov_ps(
          minus_inf, _mm512_cmple_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32(16)), limit),
          s1);
    }
    const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
    const float m_old = st.m[row];
    const float m_new = std::max(m_old, block_max);
    // m_new is -inf only while a row has seen no key, and then p is all zeros anyway.
    const float shift = m_new == -std::numeric_limits<float>::infinity() ? 0.f : m_new;
    const float c = m_old == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m_old - m_new);
    const __m512 p0 = exp512(_mm512_sub_ps(s0, _mm512_set1_ps(shift)));
    const __m512 p1 = exp512(_mm512_sub_ps(s1, _mm512_set1_ps(shift)));
    st.m[row] = m_new;
    st.l[row] = st.l[row] * c + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    st.correction[row] = c;
    _mm512_storeu_si512(st.weights.data() + r * kBlockKeys, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
  // o_r = o_r c_r + sum over key pairs of (p_j, p_j+1) . (v_j, v_j+1), 4 rows x 64 dims at a time.
  for (int r0 = 0; r0 < kTileRows; r0 += 4) {
    for (int d0 = 0; d0 < D; d0 += 64) {
      __m512 o[4][4];
      for (int r = 0; r < 4; ++r) {
        float* orow = st.o.data() + (row0 + r0 + r) * D + d0;
        const __m512 c = _mm512_set1_ps(st.correction[row0 + r0 + r]);
        for (int x = 0; x < 4; ++x) o[r][x] = _mm512_mul_ps(_mm512_loadu_ps(orow + 16 * x), c);
      }
      const uint32_t* w = reinterpret_cast<const uint32_t*>(st.weights.data()) + r0 * kBlockKeys / 2;
#pragma GCC unroll 2
      for (int jp = 0; jp < kBlockKeys / 2; ++jp) {
        const uint32_t* vrow = vp + jp * D + d0;
        __m512bh vx[4];
        for (int x = 0; x < 4; ++x) vx[x] = (__m512bh)_mm512_loadu_si512(vrow + 16 * x);
        for (int r = 0; r < 4; ++r) {
          const __m512bh pr = pair_broadcast(w[r * kBlockKeys / 2 + jp]);
          for (int x = 0; x < 4; ++x) o[r][x] = _mm512_dpbf16_ps(o[r][x], vx[x], pr);
        }
      }
      for (int r = 0; r < 4; ++r) {
        float* orow = st.o.data() + (row0 + r0 + r) * D + d0;
        for (int x = 0; x < 4; ++x) _mm512_storeu_ps(orow + 16 * x, o[r][x]);
      }
    }
  }
}

// Step 2 for one work item: KV head `head`, query positions [first, first + 32) of L.
template <int D>
void run_item(const Shapes& s, const uint16_t* q, uint16_t* out, const uint32_t* kp_all,
              const uint32_t* vp_all, int64_t head, int64_t first, ItemState& st) {
  const int64_t positions = std::min<int64_t>(kItemPositions, s.L - first);
  const int64_t rows = positions * s.G;
  const int64_t padded = (rows + kTileRows - 1) / kTileRows * kTileRows;
  st.o.assign(padded * D, 0.f);
  st.m.assign(padded, -std::numeric_limits<float>::infinity());
  st.l.assign(padded, 0.f);
  st.correction.assign(padded, 1.f);
  st.q.resize(padded);
  st.position.resize(padded);
  st.weights.resize(kTileRows * kBlockKeys);
  for (int64_t r = 0; r < padded; ++r) {
    const int64_t row = std::min(r, rows - 1);  // padding rows repeat the last row
    const int64_t i = first + row / s.G, h = head * s.G + row % s.G;
    st.q[r] = reinterpret_cast<const uint32_t*>(q + i * s.q_token_stride + h * s.q_head_stride);
    st.position[r] = s.S - s.L + i;
  }
  const int64_t last_key = st.position[padded - 1];
  const int64_t blocks = last_key / kBlockKeys + 1;
  const int64_t block_words = kBlockKeys * D / 2;
  for (int64_t block = 0; block < blocks; ++block) {
    const uint32_t* kp = kp_all + (head * s.blocks + block) * block_words;
    const uint32_t* vp = vp_all + (head * s.blocks + block) * block_words;
    const int64_t block_last = block * kBlockKeys + kBlockKeys - 1;
    for (int64_t row0 = 0; row0 < padded; row0 += kTileRows) {
      if (block * kBlockKeys > st.position[row0 + kTileRows - 1]) continue;  // all masked
      const bool masked = block_last > st.position[row0] || block_last >= s.S;
      tile_block<D>(s, st, row0, block, masked, kp, vp);
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t i = first + row / s.G, h = head * s.G + row % s.G;
    uint16_t* dst = out + i * s.out_token_stride + h * s.out_head_stride;
    const __m512 inv = _mm512_set1_ps(1.f / st.l[row]);
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(st.o.data() + row * D + d), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}

template <int D>
void run(const Shapes& s, const uint16_t* q, uint16_t* out, const uint16_t* k, const uint16_t* v) {
  const int64_t block_words = kBlockKeys * D / 2;
  // Not zeroed: pack_block writes every word (zeros past S itself).
  const std::unique_ptr<uint32_t[]> kp(new uint32_t[s.Hkv * s.blocks * block_words]);
  const std::unique_ptr<uint32_t[]> vp(new uint32_t[s.Hkv * s.blocks * block_words]);
  pagedserve::parallel_for(0, s.Hkv * s.blocks, 8, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t head = item / s.blocks, block = item % s.blocks;
      pack_block(s, k, v, head, block, kp.get() + item * block_words,
                 vp.get() + item * block_words);
    }
  });
  // Largest first: item 0 is the last 32 positions of head 0, then of head 1, ... Each
  // thread (one range each) takes the next item until none are left.
  const int64_t chunks = (s.L + kItemPositions - 1) / kItemPositions;
  const int64_t items = chunks * s.Hkv;
  std::atomic<int64_t> next{0};
  pagedserve::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    ItemState st;
    for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t chunk = chunks - 1 - item / s.Hkv, head = item % s.Hkv;
      run_item<D>(s, q, out, kp.get(), vp.get(), head, chunk * kItemPositions, st);
    }
  });
}

}  // namespace
#endif

void prefill_attention(at::Tensor out, at::Tensor query, at::Tensor key, at::Tensor value,
                       double scale) {
  TORCH_CHECK(prefill_attention_available(),
              "prefill_attention needs AVX512-BF16 (this build has no such code)");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "prefill_attention: out/query [L, Hq, D], key/value [Hkv, S, D]");
  for (const at::Tensor* t : {&out, &query, &key, &value}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->device().is_cpu() && t->stride(2) == 1,
                "prefill_attention: bfloat16 CPU tensors with contiguous last dims");
  }
  TORCH_CHECK(out.sizes() == query.sizes() && key.sizes() == value.sizes(),
              "prefill_attention: out like query, value like key");
  const int64_t L = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t Hkv = key.size(0), S = key.size(1);
  TORCH_CHECK(key.size(2) == D && Hkv > 0 && Hq % Hkv == 0 && S >= L,
              "prefill_attention: head sizes, head counts (Hq a multiple of Hkv) or S >= L wrong");
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "prefill_attention: head size 64, 128 or 256");
  if (L == 0) return;
#ifdef PAGEDSERVE_PREFILL_BF16
  Shapes s{L, S, Hkv, Hq / Hkv, D, (S + kBlockKeys - 1) / kBlockKeys,
           query.stride(0), query.stride(1), out.stride(0), out.stride(1),
           key.stride(0), key.stride(1), value.stride(0), value.stride(1),
           static_cast<float>(scale)};
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto* k = reinterpret_cast<const uint16_t*>(key.data_ptr<at::BFloat16>());
  const auto* v = reinterpret_cast<const uint16_t*>(value.data_ptr<at::BFloat16>());
  if (D == 64) run<64>(s, q, o, k, v);
  else if (D == 128) run<128>(s, q, o, k, v);
  else run<256>(s, q, o, k, v);
#endif
}
