// Row-wise fused CPU kernels: RMSNorm (with the residual add; per head for q/k norms), SiLU * up
// (GELU * up), and rotary embedding with the KV-cache write. Storage float32 or bfloat16, rounded where the torch reference
// (tpllm_kernels/reference.py) rounds; arithmetic float32.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "kernel_common.h"
#include "thread_team.h"
#include "vec.h"

namespace {

// Rows in parallel: r = x, or residual + x stored back into residual (at storage precision
// first, as torch's `residual + x` does) when residual is given; out = rms_norm(r) * weight.
// add_rms_norm_ passes out = x; rms_norm (the first layer's norm, no residual yet) passes none,
// so both norms are one computation. Why C++ for the plain norm too: torch's rms_norm is a
// composite of ~6 ops, each dispatched cold after a decode step's weight stream has evicted the
// caches: several times this one call per batch-1 step (`python -m client bench decode`).
template <typename T>
void rms_norm_rows(const at::Tensor& x, T* residual, at::Tensor& out,
                   const at::Tensor& weight, double eps) {
  const int64_t H = x.size(-1), N = x.numel() / H;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  team::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> r(H);
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = xp + row * H;
      if (residual != nullptr) {
        T* rr = residual + row * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) {
          const T sum = from_f<T>(to_f(rr[i]) + to_f(xr[i]));
          rr[i] = sum;
          r[i] = to_f(sum);
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) r[i] = to_f(xr[i]);
      }
      const float ss = sum_squares(r.data(), H);
      const float inv = 1.f / std::sqrt(ss / (float)H + (float)eps);
      T* orow = op + row * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) orow[i] = from_f<T>(to_f(wp[i]) * (r[i] * inv));
    }
  });
}

// RMSNorm of each query and key head of qkv [T, (Hq + 2 Hkv) D] in place (Qwen3, Gemma 3: before
// rotary), q heads with q_weight [D], k heads with k_weight [D]; a head's arithmetic is
// rms_norm_rows' for one row of D.
template <typename T>
void qk_norm_impl(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                  int64_t Hq, int64_t Hkv, double eps) {
  const int64_t D = q_weight.size(0), heads = Hq + Hkv, width = qkv.size(1);
  T* p = qkv.data_ptr<T>();
  const T* qw = q_weight.data_ptr<T>();
  const T* kw = k_weight.data_ptr<T>();
  team::parallel_for(0, qkv.size(0) * heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> r(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i % heads;
      T* x = p + (i / heads) * width + h * D;
      const T* w = h < Hq ? qw : kw;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) r[j] = to_f(x[j]);
      const float ss = sum_squares(r.data(), D);
      const float inv = 1.f / std::sqrt(ss / (float)D + (float)eps);
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) x[j] = from_f<T>(to_f(w[j]) * (r[j] * inv));
    }
  });
}

// silu(x) = x / (1 + exp(-x)) of one row into s[0, n), the exponential as exp_any's (exp of
// -|x|, inverted for x < 0). SIMD builds: 16 lanes at a time with the vector polynomial (GCC
// does not vectorize the scalar loop for AVX2, which then ran several times slower than torch's
// silu * up), then the tail in scalar code.
inline void silu_row(const float* x, float* s, int64_t n) {
  int64_t i = 0;
#if defined(TPLLM_SIMD16)
  using namespace simd;
  const F16 one = set1(1.f), zero = set1(0.f);
  for (; i + 16 <= n; i += 16) {
    const F16 v = load(x + i);
    const F16 en = exp_nonpositive(zero - max(v, zero - v));  // exp(-|x|)
    store(s + i, v / (one + where_nonnegative(v, en, one / en)));
  }
#endif
  for (; i < n; ++i) s[i] = x[i] / (1.f + exp_any(-x[i]));
}

// out[t, i] = silu(gate[t, i]) * up[t, i] for gate_up = [gate | up] rows. Rounds where torch's
// `F.silu(gate) * up` rounds (silu's result, then the product) so bf16 matches the reference.
template <typename T>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t N = out.size(0), I = out.size(1);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  team::parallel_for(0, N, std::max<int64_t>(1, 16384 / I), [&](int64_t begin, int64_t end) {
    std::vector<float> gate(std::is_same_v<T, float> ? 0 : I), silu(I);
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gp + t * 2 * I;
      const T* u = g + I;
      T* o = op + t * I;
      const float* gf;
      if constexpr (std::is_same_v<T, float>) {
        gf = g;
      } else {
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) gate[i] = to_f(g[i]);
        gf = gate.data();
      }
      silu_row(gf, silu.data(), I);
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = from_f<T>(to_f(from_f<T>(silu[i])) * to_f(u[i]));
    }
  });
}

template <typename T>
void rotary_write_kv_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          int64_t Hq, int64_t Hkv, at::Tensor& k_cache, at::Tensor& v_cache,
                          const at::Tensor& slots) {
  const int64_t T_ = qkv.size(0), D = cos.size(1), half = D / 2, W = qkv.size(1);
  T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t* slp = slots.data_ptr<int64_t>();
  const int64_t row = Hkv * D;  // one token's K (or V) in the cache
  team::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* x = xp + t * W;
      const T* c = cp + t * D;
      const T* s = sp + t * D;
      for (int64_t h = 0; h < Hq + Hkv; ++h) {
        T* v = x + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(v[i]), x2 = to_f(v[i + half]);
          // Each product rounded to storage precision before the sum, like the torch reference.
          const float a1 = to_f(from_f<T>(x1 * to_f(c[i])));
          const float b1 = to_f(from_f<T>((-x2) * to_f(s[i])));
          const float a2 = to_f(from_f<T>(x2 * to_f(c[i + half])));
          const float b2 = to_f(from_f<T>(x1 * to_f(s[i + half])));
          v[i] = from_f<T>(a1 + b1);
          v[i + half] = from_f<T>(a2 + b2);
        }
      }
      std::memcpy(kc + slp[t] * row, x + Hq * D, row * sizeof(T));
      std::memcpy(vc + slp[t] * row, x + (Hq + Hkv) * D, row * sizeof(T));
    }
  });
}

}  // namespace

// residual += x; x = rms_norm(residual) * weight   (both in place, rows in parallel)
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_storage(x, "add_rms_norm_");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() &&
              residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm_: contiguous tensors of one dtype only");
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows<bf16>(x, residual.data_ptr<bf16>(), x, weight, eps);
  else
    rms_norm_rows<float>(x, residual.data_ptr<float>(), x, weight, eps);
}

// rms_norm(x) * weight into a new tensor (x unchanged): see rms_norm_rows.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_storage(x, "rms_norm");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1),
              "rms_norm: contiguous x and weight of one dtype, weight over x's last dim");
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows<bf16>(x, nullptr, out, weight, eps);
  else
    rms_norm_rows<float>(x, nullptr, out, weight, eps);
  return out;
}

// qkv [T, (Hq + 2*Hkv) * D] contiguous: rotate the q and k heads in place (neox halves layout,
// cos/sin [T, D] with duplicated halves), then store k and v rows at their cache slots.
void rotary_write_kv_(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t Hq,
                      int64_t Hkv, at::Tensor k_cache, at::Tensor v_cache,
                      at::Tensor slot_mapping) {
  check_storage(qkv, "rotary_write_kv_");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
              k_cache.is_contiguous() && v_cache.is_contiguous(),
              "rotary_write_kv_: contiguous tensors only");
  for (const auto* t : {&cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "rotary_write_kv_: one dtype only");
  auto slots = slot_mapping.contiguous();
  if (qkv.scalar_type() == at::kBFloat16)
    rotary_write_kv_impl<bf16>(qkv, cos, sin, Hq, Hkv, k_cache, v_cache, slots);
  else
    rotary_write_kv_impl<float>(qkv, cos, sin, Hq, Hkv, k_cache, v_cache, slots);
}

void qk_norm_(at::Tensor qkv, at::Tensor q_weight, at::Tensor k_weight, int64_t Hq,
              int64_t Hkv, double eps) {
  check_storage(qkv, "qk_norm_");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && q_weight.is_contiguous() &&
                  k_weight.is_contiguous() && q_weight.scalar_type() == qkv.scalar_type() &&
                  k_weight.scalar_type() == qkv.scalar_type() &&
                  q_weight.numel() == k_weight.numel() &&
                  qkv.size(1) == (Hq + 2 * Hkv) * q_weight.numel(),
              "qk_norm_: contiguous qkv [T, (Hq + 2 Hkv) D] and [D] weights of its dtype");
  if (qkv.scalar_type() == at::kBFloat16)
    qk_norm_impl<bf16>(qkv, q_weight, k_weight, Hq, Hkv, eps);
  else
    qk_norm_impl<float>(qkv, q_weight, k_weight, Hq, Hkv, eps);
}

// gelu(gate, tanh approximation) * up into out (GeGLU: Gemma), as the torch reference computes
// it (torch's gelu, then the product): a decode step's few rows, where a vector tanh of our own
// would buy little next to the weight stream.
void gelu_tanh_mul_into(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t I = gate_up.size(1) / 2;
  at::gelu_out(out, gate_up.narrow(1, 0, I), "tanh");
  out.mul_(gate_up.narrow(1, I, I));
}

// gate_up [N, 2I] contiguous -> silu(gate) * up [N, I]
at::Tensor silu_mul(at::Tensor gate_up) {
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_mul_into(gate_up, out);
  return out;
}

void silu_mul_into(const at::Tensor& gate_up, at::Tensor& out) {
  check_storage(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0 &&
                  out.is_contiguous() && out.scalar_type() == gate_up.scalar_type() &&
                  out.size(0) == gate_up.size(0) && out.size(1) == gate_up.size(1) / 2,
              "silu_mul: a contiguous [N, 2I] tensor only, out [N, I]");
  if (gate_up.scalar_type() == at::kBFloat16)
    silu_mul_impl<bf16>(gate_up, out);
  else
    silu_mul_impl<float>(gate_up, out);
}
