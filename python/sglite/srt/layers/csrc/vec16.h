// 16-float vectors in GCC's vector extension, shared by sglite's C++ CPU kernels: AVX-512 where -march=native has
// it, else split by the compiler (AVX2). layers/cpu_kernel_build.py hashes this header into every kernel's build key.
#pragma once

#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

constexpr int kLanes = 16;
typedef float vec16 __attribute__((vector_size(kLanes * sizeof(float))));

inline vec16 load(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));  // unaligned
  return v;
}

inline float lane_sum(vec16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}
