// Linears whose weight stays in its GGUF block format (gguf_blocks.h): out[M, N] = x[M, K] @ W^T,
// with W [N, K] the file's own bytes (memory-mapped) and never a dense float copy.
//
// Two paths, chosen per call by the number of rows M:
//
// - Few rows (decode steps, M <= max_rows): every weight is read once per call, so a step
//   costs the bytes of the weights; the work per weight must be a few instructions.
//   Q4_K and Q6_K (the bulk of a Q4_K_M file) have integer kernels (AVX2): x is rounded
//   per row and group of 256 to int16 with a float scale (as quant_linear.cpp does per 32:
//   at most 1.5e-5 of the group's largest |x|), each 16-weight run of the block is widened
//   to int16 and multiplied by its integer sub-block scale (Q4_K: q sc <= 15 * 63; Q6_K:
//   |(q - 32) sc| <= 32 * 128), and _mm256_madd_epi16 sums those against xq, exactly in
//   int32 (bounds at each kernel). One float multiply per block (or half block) applies
//   d * dx; Q4_K's min term is d_min * dx * sum_j m_j sum(xq of sub-block j), from sums
//   kept beside xq. Other types decode each weight row to float once per call and take
//   float dot products with every row of x.
//   (AVX-512 machines run the same kernels on 512-bit vectors, vpdpwssd with VNNI.)
//   Each (row, output) is computed by the same instructions in the same order whatever
//   M is or which other rows share the call: the few-row path is batch invariant.
//
// - Many rows (prefill chunks, wide batches): a tile of output rows is decoded into x's
//   dtype (float32, or bfloat16 where the model runs in it) and multiplied with one
//   at::mm, so the matmul runs at the BLAS/oneDNN speed of a dense weight while only one
//   tile (~16 MiB) of decoded weights exists at a time. int4/int8 weights
//   (quant_linear.cpp's formats) take the same path through their own row decoder.
//
// References: pagedserve_kernels.reference.gguf_linear_ref (gguf-py's dequantize + a float32 matmul).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <functional>
#include <vector>

#include "gguf_blocks.h"
#include "group32_activations.h"
#include "madd512.h"
#include "ops.h"
#include "spin_pool.h"
#include "vec8.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using pagedserve::group32::abs_max32, pagedserve::group32::inverse_of, pagedserve::group32::round32;

constexpr int64_t kSuper = 256;  // elements of a K-quant block (and of an activation group)

// x [M, K] float32 rounded for the integer kernels: per row and group of 256,
//   dx[m, g] = max |x| / 32767,  xq = round(x / dx) (half to even),
// with sum32[m, j] = the sum of xq over each run of 32 (Q4_K's min term).
struct Int16Rows {
  std::vector<int16_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum32;
  int64_t cols = 0, groups = 0;
};

// `levels`: pagedserve::group32::activation_levels (32767, or 127 for 8-bit activations:
// the int16 kernels then take int8-valued xq).
Int16Rows quantize_rows(const float* x, int64_t rows, int64_t cols, float levels) {
  Int16Rows a;
  a.cols = cols;
  a.groups = cols / kSuper;
  a.q.resize(rows * cols);
  a.scale.resize(rows * a.groups);
  a.sum32.resize(rows * cols / 32);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < a.groups; ++g) {
      const float* xg = x + m * cols + g * kSuper;
      float amax = 0.f;
      for (int64_t j = 0; j < kSuper / 32; ++j) amax = std::max(amax, abs_max32(xg + 32 * j));
      const float scale = amax / levels;
      const float inverse = inverse_of(scale);
      for (int64_t j = 0; j < kSuper / 32; ++j)
        a.sum32[(m * cols + g * kSuper) / 32 + j] =
            round32(xg + 32 * j, inverse, a.q.data() + m * cols + g * kSuper + 32 * j, 8);
      a.scale[m * a.groups + g] = scale;
    }
  return a;
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i madd_pair(__m256i w_lo, __m256i w_hi, const int16_t* x) {
  return _mm256_add_epi32(
      _mm256_madd_epi16(w_lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
      _mm256_madd_epi16(w_hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
}

// Q6_K: half h (0, 1) of a block as four vectors of 32 six-bit values q (unsigned,
// 0..63): v[t] = elements 32t .. 32t + 31 of the half (see gguf_blocks.h for where the
// bits sit: low nibbles of ql for t = 0, 1, high nibbles for t = 2, 3; bits 2t, 2t + 1
// of qh above them).
inline void q6k_half(const uint8_t* block, int h, __m256i v[4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
  const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h));
  const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
  const __m256i low[4] = {_mm256_and_si256(ql0, low4), _mm256_and_si256(ql1, low4),
                          _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                          _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4)};
  for (int t = 0; t < 4; ++t)
    v[t] = _mm256_or_si256(
        low[t], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), low2), 4));
}

// Q4_K, rows m0..m0+R-1 of x against one weight row. Per block and lane, the int32 sum
// gathers 32 products of |q sc| <= 945 and |xq| <= 32767: < 9.9e8, no overflow.
template <int R>
void q4k_rows(const uint8_t* wrow, const Int16Rows& a, int64_t m0, float* out,
              int64_t out_stride) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R], min_acc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    min_acc[r] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* block = wrow + g * 144;
    const float d = gguf::half_at(block), dmin = gguf::half_at(block + 2);
    uint8_t sc[8], mn[8];
    gguf::unpack_k4_scales(block + 4, sc, mn);
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // 64 elements: low nibbles sub-block 2c, high 2c + 1
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * c));
      const __m256i lo = _mm256_and_si256(bytes, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      const __m256i s_lo = _mm256_set1_epi16(sc[2 * c]), s_hi = _mm256_set1_epi16(sc[2 * c + 1]);
      const __m256i w0 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo)), s_lo);
      const __m256i w1 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1)), s_lo);
      const __m256i w2 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi)), s_hi);
      const __m256i w3 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1)), s_hi);
      for (int r = 0; r < R; ++r) {
        const int16_t* x = a.q.data() + (m0 + r) * a.cols + g * kSuper + 64 * c;
        sums[r] = _mm256_add_epi32(sums[r], _mm256_add_epi32(madd_pair(w0, w1, x),
                                                             madd_pair(w2, w3, x + 32)));
      }
    }
    const __m256i mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
    for (int r = 0; r < R; ++r) {
      const float dx = a.scale[(m0 + r) * a.groups + g];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(d * dx), acc[r]);
      // m_j * sum(xq of sub-block j) for the 8 sub-blocks at once (|.| < 63 * 2^20)
      const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          a.sum32.data() + ((m0 + r) * a.cols + g * kSuper) / 32));
      min_acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(mins, xs)),
                                   _mm256_set1_ps(dmin * dx), min_acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[(m0 + r) * out_stride] = hsum(acc[r]) - hsum(min_acc[r]);
}

// Q6_K, rows m0..m0+R-1 against one weight row, a half block (128) at a time. Per half and
// lane, the int32 sum gathers 16 products of |(q - 32) sc| <= 4096 and |xq| <= 32767:
// <= 2,147,418,112 < 2^31, no overflow (a whole block could: hence the halves).
template <int R>
void q6k_rows(const uint8_t* wrow, const Int16Rows& a, int64_t m0, float* out,
              int64_t out_stride) {
  const __m256i bias = _mm256_set1_epi8(32);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* block = wrow + g * 210;
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
    const float d = gguf::half_at(block + 208);
    for (int h = 0; h < 2; ++h) {
      __m256i v[4];
      q6k_half(block, h, v);
      __m256i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        const __m256i q = _mm256_sub_epi8(v[t], bias);
        const int s = 8 * h + 2 * t;  // sub-blocks s (first 16) and s + 1 (next 16)
        const __m256i w0 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)),
                                              _mm256_set1_epi16(sc[s]));
        const __m256i w1 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)),
                                              _mm256_set1_epi16(sc[s + 1]));
        for (int r = 0; r < R; ++r) {
          const int16_t* x = a.q.data() + (m0 + r) * a.cols + g * kSuper + 128 * h + 32 * t;
          sums[r] = _mm256_add_epi32(sums[r], madd_pair(w0, w1, x));
        }
      }
      for (int r = 0; r < R; ++r) {
        const float dx = a.scale[(m0 + r) * a.groups + g];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(d * dx), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[(m0 + r) * out_stride] = hsum(acc[r]);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The same two kernels on 512-bit vectors (half the instructions per weight; with
// AVX512-VNNI each multiply-add-accumulate is one vpdpwssd). Same integer sums, so the
// same bounds; the float accumulation runs in 16 lanes instead of 8.
inline __m512i dot_accumulate(__m512i acc, __m512i w, const int16_t* x) {
  return madd_accumulate(acc, w, _mm512_loadu_si512(x));
}

template <int R>
void q4k_rows_512(const uint8_t* wrow, const Int16Rows& a, int64_t m0, float* out,
                  int64_t out_stride) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m512 acc[R];
  __m256 min_acc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    min_acc[r] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* block = wrow + g * 144;
    const float d = gguf::half_at(block), dmin = gguf::half_at(block + 2);
    alignas(8) uint8_t sc[8], mn[8];
    gguf::unpack_k4_scales(block + 4, sc, mn);
    __m512i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {  // 64 elements: low nibbles sub-block 2c, high 2c + 1
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * c));
      const __m512i w0 = _mm512_mullo_epi16(
          _mm512_cvtepu8_epi16(_mm256_and_si256(bytes, low4)), _mm512_set1_epi16(sc[2 * c]));
      const __m512i w1 = _mm512_mullo_epi16(
          _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4)),
          _mm512_set1_epi16(sc[2 * c + 1]));
      for (int r = 0; r < R; ++r) {
        const int16_t* x = a.q.data() + (m0 + r) * a.cols + g * kSuper + 64 * c;
        sums[r] = dot_accumulate(dot_accumulate(sums[r], w0, x), w1, x + 32);
      }
    }
    const __m256i mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
    for (int r = 0; r < R; ++r) {
      const float dx = a.scale[(m0 + r) * a.groups + g];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_set1_ps(d * dx), acc[r]);
      // m_j * sum(xq of sub-block j) for the 8 sub-blocks at once (|.| < 63 * 2^20)
      const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          a.sum32.data() + ((m0 + r) * a.cols + g * kSuper) / 32));
      min_acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(mins, xs)),
                                   _mm256_set1_ps(dmin * dx), min_acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[(m0 + r) * out_stride] = _mm512_reduce_add_ps(acc[r]) - hsum(min_acc[r]);
}

template <int R>
void q6k_rows_512(const uint8_t* wrow, const Int16Rows& a, int64_t m0, float* out,
                  int64_t out_stride) {
  const __m256i bias = _mm256_set1_epi8(32);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* block = wrow + g * 210;
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
    const float d = gguf::half_at(block + 208);
    for (int h = 0; h < 2; ++h) {
      __m256i v[4];
      q6k_half(block, h, v);
      __m512i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {
        const int s = 8 * h + 2 * t;  // the first 16 values in sub-block s, the next in s + 1
        const __m512i scale = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_set1_epi16(sc[s])), _mm256_set1_epi16(sc[s + 1]), 1);
        const __m512i w = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm256_sub_epi8(v[t], bias)),
                                             scale);
        for (int r = 0; r < R; ++r)
          sums[r] = dot_accumulate(
              sums[r], w, a.q.data() + (m0 + r) * a.cols + g * kSuper + 128 * h + 32 * t);
      }
      for (int r = 0; r < R; ++r) {
        const float dx = a.scale[(m0 + r) * a.groups + g];
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_set1_ps(d * dx), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[(m0 + r) * out_stride] = _mm512_reduce_add_ps(acc[r]);
}
#define Q4K_ROWS q4k_rows_512
#define Q6K_ROWS q6k_rows_512
#elif defined(__AVX2__)
#define Q4K_ROWS q4k_rows
#define Q6K_ROWS q6k_rows
#endif

bool has_integer_kernel(int64_t type) {
#if defined(__AVX2__)
  return type == gguf::Q4_K || type == gguf::Q6_K;
#else
  (void)type;
  return false;
#endif
}

// sum_k a[k] b[k] in 8 float lanes, reduced in a fixed order.
float dot(const float* a, const float* b, int64_t k) {
  vec8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) acc += load8(a + i) * load8(b + i);
  float total = sum8(acc);
  for (; i < k; ++i) total += a[i] * b[i];
  return total;
}

constexpr int64_t kRowBlock = 4;  // rows of x per pass over a decoded weight row
#if defined(__AVX512F__)
// 512-bit registers hold 8 rows' sums and accumulators (plus the decoded weights) in the
// 32 vector registers: 8 decode steps (a batch of 8) decode each weight row once.
constexpr int64_t kWideRowBlock = 8;
#else
constexpr int64_t kWideRowBlock = kRowBlock;
#endif

// The few-row path: x float32 [M, K] -> out float32 [M, N].
at::Tensor few_rows(const at::Tensor& x, const uint8_t* weight, int64_t row_bytes, int64_t type,
                    int64_t num_out) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const float* xp = x.data_ptr<float>();
  at::Tensor out = at::empty({rows, num_out}, x.options());
  float* op = out.data_ptr<float>();
  if (has_integer_kernel(type)) {
#if defined(__AVX2__)
    const Int16Rows a = quantize_rows(
        xp, rows, cols, pagedserve::group32::activation_levels(pagedserve::group32::activation_bits()));
    pagedserve::parallel_for(0, num_out, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const uint8_t* wrow = weight + n * row_bytes;
        int64_t m0 = 0;
        if (type == gguf::Q4_K) {
          for (; m0 + kWideRowBlock <= rows; m0 += kWideRowBlock)
            Q4K_ROWS<kWideRowBlock>(wrow, a, m0, op + n, num_out);
          for (; m0 + kRowBlock <= rows; m0 += kRowBlock)
            Q4K_ROWS<kRowBlock>(wrow, a, m0, op + n, num_out);
          for (; m0 < rows; ++m0) Q4K_ROWS<1>(wrow, a, m0, op + n, num_out);
        } else {
          for (; m0 + kWideRowBlock <= rows; m0 += kWideRowBlock)
            Q6K_ROWS<kWideRowBlock>(wrow, a, m0, op + n, num_out);
          for (; m0 + kRowBlock <= rows; m0 += kRowBlock)
            Q6K_ROWS<kRowBlock>(wrow, a, m0, op + n, num_out);
          for (; m0 < rows; ++m0) Q6K_ROWS<1>(wrow, a, m0, op + n, num_out);
        }
      }
    });
#endif
    return out;
  }
  pagedserve::parallel_for(0, num_out, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(cols);
    for (int64_t n = begin; n < end; ++n) {
      gguf::dequantize_row(type, weight + n * row_bytes, w.data(), cols);
      for (int64_t m = 0; m < rows; ++m) op[m * num_out + n] = dot(xp + m * cols, w.data(), cols);
    }
  });
  return out;
}

using RowDecoder = std::function<void(int64_t row, float* dst)>;

#if defined(__AVX2__)
// 8 unsigned bytes -> 8 floats.
inline __m256 bytes_to_floats(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
// Vectorised float decoders for the tiles of the hot formats (the scalar ones of
// gguf_blocks.h index every element; these take 8 at a time): the same values, tested
// against gguf-py through the tiled path.

void decode_q4k_row(const uint8_t* row, float* y, int64_t cols) {
  alignas(32) uint8_t q[64];
  for (int64_t g = 0; g < cols / kSuper; ++g, y += kSuper) {
    const uint8_t* block = row + g * 144;
    const float d = gguf::half_at(block), dmin = gguf::half_at(block + 2);
    uint8_t sc[8], mn[8];
    gguf::unpack_k4_scales(block + 4, sc, mn);
    for (int c = 0; c < 4; ++c) {  // 64 elements: low nibbles sub-block 2c, high 2c + 1
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * c));
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), _mm256_and_si256(bytes, low4));
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32),
                         _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4));
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * c + half;
        const __m256 scale = _mm256_set1_ps(d * sc[j]), offset = _mm256_set1_ps(-dmin * mn[j]);
        for (int i = 0; i < 32; i += 8)
          _mm256_storeu_ps(y + 64 * c + 32 * half + i,
                           _mm256_fmadd_ps(bytes_to_floats(q + 32 * half + i), scale, offset));
      }
    }
  }
}

void decode_q6k_row(const uint8_t* row, float* y, int64_t cols) {
  alignas(32) int8_t q[128];
  const __m256i bias = _mm256_set1_epi8(32);
  for (int64_t g = 0; g < cols / kSuper; ++g, y += kSuper) {
    const uint8_t* block = row + g * 210;
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
    const float d = gguf::half_at(block + 208);
    for (int h = 0; h < 2; ++h) {
      __m256i v[4];
      q6k_half(block, h, v);
      for (int t = 0; t < 4; ++t)
        _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * t), _mm256_sub_epi8(v[t], bias));
      for (int i = 0; i < 128; i += 8) {
        const __m256 values = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i))));
        _mm256_storeu_ps(y + 128 * h + i,
                         _mm256_mul_ps(values, _mm256_set1_ps(d * sc[8 * h + i / 16])));
      }
    }
  }
}
#endif

// One weight row in a GGUF format -> floats, vectorised where a decoder above exists.
void decode_gguf_row(int64_t type, const uint8_t* row, float* y, int64_t cols) {
#if defined(__AVX2__) && defined(__F16C__)
  if (type == gguf::Q4_K) return decode_q4k_row(row, y, cols);
  if (type == gguf::Q6_K) return decode_q6k_row(row, y, cols);
#endif
  gguf::dequantize_row(type, row, y, cols);
}

// The many-row path: tiles of decoded weight rows in x's dtype, one at::mm each.
// decode(n, dst) writes rows n .. n + unit - 1 (float32 [unit, K]) to dst; num_out is a
// multiple of unit (1 for the row decoders, 16 for blocked int4 / int8).
at::Tensor tiled(const at::Tensor& x, int64_t num_out, const RowDecoder& decode,
                 int64_t unit = 1) {
  const int64_t rows = x.size(0), cols = x.size(1);
  // Tiles of ~16 MiB: few enough that the per-call costs of at::mm and of waking the
  // threads (a scheduler slice each when another process holds a core) stay small, small
  // enough to be transient. An lm_head of 49152 x 2048 in bfloat16: 12 tiles of 4096 rows.
  static const int64_t tile_bytes = [] {
    const char* env = std::getenv("PAGEDSERVE_TILE_KIB");
    return (env ? std::atoll(env) : 16384) * 1024;
  }();
  const int64_t tile_rows = std::min(
      num_out, std::max<int64_t>(16, tile_bytes / (cols * x.element_size())) / unit * unit);
  at::Tensor out = at::empty({rows, num_out}, x.options());
  at::Tensor tile = at::empty({tile_rows, cols}, x.options());
  const auto dtype = x.scalar_type();
  for (int64_t n0 = 0; n0 < num_out; n0 += tile_rows) {
    const int64_t count = std::min(tile_rows, num_out - n0);
    at::parallel_for(0, count / unit, std::max<int64_t>(1, 8 / unit), [&](int64_t begin, int64_t end) {
      std::vector<float> buffer(unit * cols);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t r = u * unit;
        float* dst = dtype == at::kFloat ? tile.data_ptr<float>() + r * cols : buffer.data();
        decode(n0 + r, dst);
        if (dtype == at::kBFloat16) {
          store_floats(buffer.data(), tile.data_ptr<c10::BFloat16>() + r * cols, unit * cols);
        } else if (dtype == at::kHalf) {
          c10::Half* t = tile.data_ptr<c10::Half>() + r * cols;
          for (int64_t k = 0; k < unit * cols; ++k) t[k] = c10::Half(buffer[k]);
        }
      }
    });
    out.narrow(1, n0, count).copy_(at::mm(x, tile.narrow(0, 0, count).t()));
  }
  return out;
}

void check_x(const at::Tensor& x, int64_t cols) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                   x.scalar_type() == at::kHalf),
              "x must be a contiguous float32/bfloat16/float16 [M, K] tensor");
  TORCH_CHECK(x.size(1) == cols, "x has ", x.size(1), " columns, the weight ", cols);
}

int64_t checked_columns(const at::Tensor& raw, int64_t type, int64_t cols) {
  const gguf::BlockFormat f = gguf::block_format(type);
  TORCH_CHECK(f.elements > 0, "GGML type ", type, " has no decoder here");
  TORCH_CHECK(cols > 0 && cols % f.elements == 0, "K = ", cols,
              " is not a multiple of the type's block (", f.elements, ")");
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() &&
                  raw.size(1) == cols / f.elements * f.bytes,
              "raw must be a contiguous uint8 [N, ", cols / f.elements * f.bytes, "] tensor");
  return raw.size(1);
}

}  // namespace

at::Tensor gguf_dequantize(at::Tensor raw, int64_t type, int64_t cols) {
  const int64_t row_bytes = checked_columns(raw, type, cols);
  const int64_t rows = raw.size(0);
  at::Tensor out = at::empty({rows, cols}, raw.options().dtype(at::kFloat));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      gguf::dequantize_row(type, src + n * row_bytes, dst + n * cols, cols);
  });
  return out;
}

at::Tensor gguf_linear(at::Tensor x, at::Tensor raw, int64_t type, int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t cols = x.size(1);
  const int64_t row_bytes = checked_columns(raw, type, cols);
  check_x(x, cols);
  const uint8_t* weight = raw.data_ptr<uint8_t>();
  const int64_t num_out = raw.size(0);
  if (x.size(0) <= max_rows) {
    const at::Tensor x32 = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
    at::Tensor out = few_rows(x32, weight, row_bytes, type, num_out);
    return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
  }
  return tiled(x, num_out, [&](int64_t n, float* dst) {
    decode_gguf_row(type, weight + n * row_bytes, dst, cols);
  });
}

// Rows `ids` of a blocked int4 / int8 weight (quant_blocked.cpp's layouts) as float32
// [len(ids), K], an embedding lookup: each row's block decoded as the tiled path decodes
// it (once for a run of ids in the same block), the row copied out.
at::Tensor blocked_rows(at::Tensor data, at::Tensor scales, at::Tensor mins, at::Tensor ids,
                        int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  check_blocked_weight(data, scales, mins, bits);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be int64 [R]");
  const at::Tensor index = ids.contiguous();
  const int64_t* rows = index.data_ptr<int64_t>();
  const int64_t count = index.numel(), cols = data.size(1) * 32, num_rows = data.size(0) * 16;
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(rows[i] >= 0 && rows[i] < num_rows, "row ", rows[i], " is out of range");
  at::Tensor out = at::empty({count, cols}, data.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> block(16 * cols);
    int64_t decoded = -1;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = rows[i] / 16;
      if (b != decoded) {
        if (bits == 4) {
          decode_blocked_int4(data, scales, mins, b, block.data());
        } else {
          decode_blocked_int8(data, scales, mins, b, block.data());
        }
        decoded = b;
      }
      std::copy_n(block.data() + (rows[i] % 16) * cols, cols, op + i * cols);
    }
  });
  return out;
}

// int4 / int8 in quant_linear.cpp's or quant_blocked.cpp's formats, tiled.
at::Tensor quant_tiled_linear(at::Tensor x, at::Tensor data, at::Tensor scales, at::Tensor mins,
                              int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  if (is_blocked(data)) {  // quant_blocked.cpp's layouts
    check_blocked_weight(data, scales, mins, bits);
    check_x(x, data.size(1) * 32);
    return tiled(x, data.size(0) * 16, [&](int64_t n, float* dst) {
      if (bits == 4) {
        decode_blocked_int4(data, scales, mins, n / 16, dst);
      } else {
        decode_blocked_int8(data, scales, mins, n / 16, dst);
      }
    }, 16);
  }
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && scales.is_contiguous() &&
                  scales.scalar_type() == at::kHalf && scales.dim() == 2 &&
                  scales.size(0) == data.size(0),
              "data [N, K / 2 or K] and float16 scales [N, K / 32] must be contiguous");
  const int64_t num_out = data.size(0), cols = scales.size(1) * 32;
  TORCH_CHECK(data.size(1) == (bits == 4 ? cols / 2 : cols), "data has the wrong width");
  TORCH_CHECK(bits == 8 || (mins.defined() && mins.sizes() == scales.sizes() &&
                            mins.scalar_type() == at::kHalf && mins.is_contiguous()),
              "int4 needs float16 mins shaped like scales");
  check_x(x, cols);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(data.data_ptr());
  const c10::Half* s = scales.data_ptr<c10::Half>();
  const c10::Half* m = bits == 4 ? mins.data_ptr<c10::Half>() : nullptr;
  const int64_t groups = cols / 32;
  return tiled(x, num_out, [&](int64_t n, float* dst) {
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = s[n * groups + g];
      float* y = dst + g * 32;
      if (bits == 8) {
        const int8_t* q = reinterpret_cast<const int8_t*>(w) + n * cols + g * 32;
        for (int j = 0; j < 32; ++j) y[j] = scale * q[j];
      } else {
        const float lowest = m[n * groups + g];
        const uint8_t* q = w + n * (cols / 2) + g * 16;
#if defined(__AVX2__)
        // Bytes j hold q[j] | q[j + 16] << 4: low nibbles first, then high, 8 at a time.
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
        const __m128i low4 = _mm_set1_epi8(0x0F);
        alignas(16) uint8_t nibbles[32];
        _mm_store_si128(reinterpret_cast<__m128i*>(nibbles), _mm_and_si128(packed, low4));
        _mm_store_si128(reinterpret_cast<__m128i*>(nibbles + 16),
                        _mm_and_si128(_mm_srli_epi16(packed, 4), low4));
        const __m256 scale8 = _mm256_set1_ps(scale), lowest8 = _mm256_set1_ps(lowest);
        for (int j = 0; j < 32; j += 8)
          _mm256_storeu_ps(y + j, _mm256_fmadd_ps(bytes_to_floats(nibbles + j), scale8, lowest8));
#else
        for (int j = 0; j < 16; ++j) y[j] = lowest + scale * static_cast<float>(q[j] & 0x0F);
        for (int j = 0; j < 16; ++j) y[j + 16] = lowest + scale * static_cast<float>(q[j] >> 4);
#endif
      }
    }
  });
}
