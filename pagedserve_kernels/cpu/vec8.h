// 8 floats, one AVX register (GCC/Clang vector extension; plain loops elsewhere),
// shared by the CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

typedef float vec8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// v in every lane (one vbroadcastss; a lane-by-lane loop compiles to a chain of inserts).
inline vec8 broadcast8(float v) {
#if defined(__AVX__)
  return (vec8)_mm256_set1_ps(v);
#else
  vec8 out;
  for (int l = 0; l < 8; ++l) out[l] = v;
  return out;
#endif
}

inline float sum8(vec8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// 8 bfloat16 / float16 values widened to float32 (exact).
inline vec8 load8(const c10::BFloat16* p) {
#if defined(__AVX2__)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vec8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
#else
  vec8 v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline vec8 load8(const c10::Half* p) {
#if defined(__F16C__)
  return (vec8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vec8 v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// 8 int8 values widened to float32 (exact): the int8 KV cache's rows (engine/attention/kv_int8.py).
inline vec8 load8(const int8_t* p) {
#if defined(__AVX2__)
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (vec8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
#else
  vec8 v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// n floats -> bfloat16, round to nearest even (as c10::BFloat16(float) does; NaN aside).
inline void store_floats(const float* x, c10::BFloat16* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#elif defined(__AVX2__)
  const __m256i rounding = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(x + i));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, rounding), lsb), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                            _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), packed);
  }
#endif
  for (; i < n; ++i) y[i] = c10::BFloat16(x[i]);
}

// n floats -> float16 (round to nearest even, as c10::Half(float) does).
inline void store_floats(const float* x, c10::Half* y, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) y[i] = c10::Half(x[i]);
}

inline void store_floats(const float* x, float* y, int64_t n) {
  std::memcpy(y, x, n * sizeof(float));
}

// n bfloat16 / float16 values widened to float32 (exact).
template <typename T>
inline void load_floats(const T* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const vec8 v = load8(x + i);
    std::memcpy(y + i, &v, sizeof v);
  }
  for (; i < n; ++i) y[i] = static_cast<float>(x[i]);
}
