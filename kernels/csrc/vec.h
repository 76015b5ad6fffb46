// Fixed-width float vectors (GCC/Clang vector extensions: AVX-512 or 2 x AVX2 on x86, NEON on
// Arm) shared by the CPU kernels. Lanes are summed as a fixed tree (sum16), never one by one as
// the compiler's `omp simd` reductions do, and always in the same order.
#pragma once

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

inline v16f load16(const float* p) {
  v16f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16f v) { __builtin_memcpy(p, &v, sizeof(v)); }

// in registers (a scalar loop over a stored vector stalls on store forwarding: it made the GEMV
// 10% slower)
inline float sum16(v16f v) {
  v8f a, b;
  __builtin_memcpy(&a, &v, sizeof(a));
  __builtin_memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof(a), sizeof(b));
  const v8f s8 = a + b;
  v4f c, d;
  __builtin_memcpy(&c, &s8, sizeof(c));
  __builtin_memcpy(&d, reinterpret_cast<const char*>(&s8) + sizeof(c), sizeof(d));
  const v4f s4 = c + d;
  return (s4[0] + s4[1]) + (s4[2] + s4[3]);
}
