// acc + the pairwise int16 products of a and b summed into int32 lanes, on 512-bit
// vectors: one vpdpwssd with AVX512-VNNI, else vpmaddwd + vpaddd (the same sums).
// Lane i: acc[i] + a[2i] b[2i] + a[2i + 1] b[2i + 1]. Shared by the int4/int8 blocked
// kernels (quant_blocked.cpp) and the GGUF K-quant kernels (gguf_linear.cpp).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

inline __m512i madd_accumulate(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
#endif
