// Shared by the int4/int8 kernels (quant_linear.cpp, quant_blocked.cpp, gguf_linear.cpp): x
// rounded per row and group of 32 columns to int16 (or int8, see below), and float16 scale
// helpers. The rounding's error bound is worked out at the top of quant_linear.cpp.
//
// Activation precision (PAGEDSERVE_ACTIVATION_PRECISION, set from Python by
// pagedserve_kernels.cpu_kernels through set_activation_bits): with 16 bits x is rounded to
// xq = round(x / dx), dx = max |x| / 32767 per group; with 8 bits dx = max |x| / 127 and
// |xq| <= 127, as llama.cpp's Q8_0 blocks. Every few-row kernel computes the same formula
// from xq whichever precision; with 8 bits the kernels that have an 8-bit instruction path
// (quant_blocked.cpp: vpdpbusd / maddubs, four u8 x s8 products per 32-bit lane, twice
// vpdpwssd's two) store xq as int8 and take it, the others take the int8-valued xq in their
// int16 code: the same integers, so the same results.
#pragma once

#include <atomic>

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedserve::group32 {

constexpr int64_t kGroup = 32;

// The default where Python sets nothing (the ISA test builds): int16.
inline std::atomic<int> g_activation_bits{16};
inline int activation_bits() { return g_activation_bits.load(std::memory_order_relaxed); }
inline void set_activation_bits(int bits) { g_activation_bits.store(bits == 8 ? 8 : 16); }
// The largest |xq| of a precision: 32767 (int16) or 127 (int8).
inline float activation_levels(int bits) { return bits == 8 ? 127.f : 32767.f; }

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

// The two steps of rounding x to int16, 32 values at a time (also the GGUF kernels' groups
// of 256: gguf_linear.cpp). The vector paths take the scalar path's operations: the same
// max (exact in any order), the same product x * inverse rounded half to even (cvtps2dq
// and nearbyint both use the default rounding mode), the same integer sum; so every build
// gives the same bits.

// max |x[k]| over 32 values.
inline float abs_max32(const float* x) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x)),
                                            _mm512_abs_ps(_mm512_loadu_ps(x + 16))));
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
  float amax = 0.f;
  for (int64_t k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(x[k]));
  return amax;
#endif
}

// xq[k] = round(x[k] * inverse) for 32 values, returns sum(xq). The four runs of 8
// (k 0-7, 8-15, 16-23, 24-31) go to dst, dst + run_stride, dst + 2 run_stride, and
// dst + 3 run_stride (run_stride 8: in order).
inline int32_t round32(const float* x, float inverse, int16_t* dst, int64_t run_stride) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 inv = _mm512_set1_ps(inverse);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), inv));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), inv));
  const __m256i h0 = _mm512_cvtepi32_epi16(q0), h1 = _mm512_cvtepi32_epi16(q1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(h0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + run_stride), _mm256_extracti128_si256(h0, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * run_stride), _mm256_castsi256_si128(h1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 3 * run_stride), _mm256_extracti128_si256(h1, 1));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(__AVX2__)
  const __m256 inv = _mm256_set1_ps(inverse);
  __m256i total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), inv));
    total = _mm256_add_epi32(total, q);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i * run_stride),
                     _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
  }
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1)));
#else
  int32_t sum = 0;
  for (int64_t k = 0; k < kGroup; ++k) {
    const int16_t q = static_cast<int16_t>(std::nearbyint(x[k] * inverse));
    dst[(k / 8) * run_stride + k % 8] = q;
    sum += q;
  }
  return sum;
#endif
}

// 1 / scale, or 0 for an all-zero group (scale 0).
inline float inverse_of(float scale) { return scale > 0.f ? 1.f / scale : 0.f; }

// `levels`: activation_levels(bits); the values are int16 either way (int8-valued with 127).
inline QuantizedActivations quantize_activations(const float* x, int64_t rows, int64_t cols,
                                          bool pairs, bool transposed, float levels = 32767.f) {
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
      // pairs: run r (k = 8 r .. 8 r + 7) of group g sits at run 2 r + g % 2 of the pair's
      // 64 values; natural order: at g * 32 + 8 r.
      int16_t* dst = qa.values.data() + m * qa.stride +
                     (pairs ? (g / 2) * 2 * kGroup + (g % 2) * 8 : g * kGroup);
      const float* xg = x + m * cols + g * kGroup;
      const float scale = abs_max32(xg) / levels;
      const int32_t sum = round32(xg, inverse_of(scale), dst, pairs ? 16 : 8);
      qa.scales[m * groups + g] = scale;
      qa.sums[m * groups + g] = scale * static_cast<float>(sum);
      if (transposed) {
        qa.scales_t[g * rows + m] = qa.scales[m * groups + g];
        qa.sums_t[g * rows + m] = qa.sums[m * groups + g];
      }
    }
  return qa;
}

// xq[k] = round(x[k] * inverse) for 32 values stored as int8 (|xq| <= 127: inverse is
// 127 / max |x| rounded, and amax * inverse stays below 127.5), returns sum(xq). The same
// products and rounding as round32, so the int8 values equal round32's int16 ones.
inline int32_t round32_int8(const float* x, float inverse, int8_t* dst) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 inv = _mm512_set1_ps(inverse);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), inv));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(q1));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(__AVX2__)
  const __m256 inv = _mm256_set1_ps(inverse);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), inv));
  // packs work per 128-bit half: bytes [q0 0-3, q1 0-3, q2 0-3, q3 0-3 | q0 4-7, ...];
  // the dword permutation (0 4 1 5 2 6 3 7) puts them back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1)));
#else
  int32_t sum = 0;
  for (int64_t k = 0; k < kGroup; ++k) {
    const float v = std::nearbyint(x[k] * inverse);
    const int8_t q = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
    dst[k] = q;
    sum += q;
  }
  return sum;
#endif
}

// x [M, K] float32 rounded to int8 per row and group of 32 (the 8-bit kernels' input):
// values [M, K] in natural order, dx [M, G], sums [M, G] = dx * sum(xq) as above, and
// with `offset` each value stored as xq + 128 (uint8; the bytes xor 0x80): the unsigned
// side of u8 x s8 products against signed int8 weights.
struct Int8Activations {
  std::vector<int8_t> values;
  std::vector<float> scales, sums;
};

// Rows are independent: `for_rows(begin, end, fn)` runs fn(m0, m1) over ranges of rows covering
// 0 .. rows - 1 (serially by default; a many-row caller passes its thread pool's parallel_for).
struct SerialRows {
  template <typename F>
  void operator()(int64_t begin, int64_t end, const F& fn) const { fn(begin, end); }
};

template <typename ForRows = SerialRows>
inline Int8Activations quantize_activations_int8(const float* x, int64_t rows, int64_t cols,
                                                 bool offset = false,
                                                 const ForRows& for_rows = ForRows{}) {
  const int64_t groups = cols / kGroup;
  Int8Activations qa;
  qa.values.resize(rows * cols);
  qa.scales.resize(rows * groups);
  qa.sums.resize(rows * groups);
  for_rows(0, rows, [&](int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + m * cols + g * kGroup;
      int8_t* dst = qa.values.data() + m * cols + g * kGroup;
      const float scale = abs_max32(xg) / activation_levels(8);
      const int32_t sum = round32_int8(xg, inverse_of(scale), dst);
      if (offset)
        for (int64_t k = 0; k < kGroup; ++k) dst[k] = static_cast<int8_t>(dst[k] ^ 0x80);
      qa.scales[m * groups + g] = scale;
      qa.sums[m * groups + g] = scale * static_cast<float>(sum);
    }
  });
  return qa;
}

}  // namespace pagedserve::group32
