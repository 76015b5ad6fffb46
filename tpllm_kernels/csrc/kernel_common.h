// What the fused kernels' translation units share: float <-> storage conversions as plain bit
// operations, the dot product and sums in a fixed order, the vectorizable exp, and the storage
// check. Kept in an unnamed namespace (each translation unit its own copy, as when they were one
// file) so nothing here is an exported symbol.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

using bf16 = c10::BFloat16;

// float <-> storage conversions as plain bit operations, so `omp simd` loops vectorize (c10's
// BFloat16 conversions do not, which made a bf16 silu_mul ten times torch's). Same rounding as
// c10 (to nearest even; NaN -> 0x7FC0).
inline float to_f(float x) { return x; }
inline float to_f(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename T>
inline T from_f(float f);
template <>
inline float from_f<float>(float f) { return f; }
template <>
inline bf16 from_f<bf16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return bf16(static_cast<uint16_t>(f != f ? 0x7FC0u : rounded), bf16::from_bits());
}

// Sums below run in 16 lanes added as a fixed tree (vec.h's sum16), not as `omp simd`
// reductions, whose order follows the build's vector width: every ISA variant of the module
// then computes the same bits.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  v16f acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16f bv;
    for (int l = 0; l < 16; ++l) bv[l] = to_f(b[i + l]);
    acc += load16(a + i) * bv;
  }
  float s = sum16(acc);
  for (; i < n; ++i) s += a[i] * to_f(b[i]);
  return s;
}

// the sum of x[0, n) squared, in dot's order
inline float sum_squares(const float* x, int64_t n) {
  v16f acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16f v = load16(x + i);
    acc += v * v;
  }
  float s = sum16(acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

template <typename T>
inline void axpy(float* y, const T* x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * to_f(x[i]);
}

// exp(x) for x <= 0 (softmax arguments), vectorizable: 2^k * p(r) with x = k ln2 + r, |r| <=
// ln2/2, p a degree-6 Taylor polynomial (relative error < 2e-7); underflows to 0 below -87.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float k = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// exp(x) for any x, vectorizable (same polynomial); saturates to inf above 88.7.
inline float exp_any(float x) {
  return x <= 0.f ? exp_nonpositive(x) : 1.f / exp_nonpositive(-x);
}

inline void check_storage(const at::Tensor& t, const char* fn) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, fn,
              ": float32 or bfloat16 only");
}

}  // namespace
