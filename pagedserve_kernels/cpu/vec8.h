// 8 floats, one AVX register (GCC/Clang vector extension; plain loops elsewhere),
// shared by the CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

typedef float vec8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
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
