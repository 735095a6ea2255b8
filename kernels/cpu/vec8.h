// 8 floats, one AVX register (GCC/Clang vector extension; plain loops elsewhere),
// shared by the CPU kernels.
#pragma once

#include <cstring>

typedef float vec8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float sum8(vec8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}
