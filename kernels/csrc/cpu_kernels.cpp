// Fused CPU kernels for the decode-heavy path, where torch's per-op dispatch and the paged-KV
// gather (copy, then attend) cost more than the arithmetic. float32 only; every function has a
// torch reference in kernels/reference.py that the tests compare against.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, const float* x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

}  // namespace

// q [B, Hq, D]; caches [NB, BS, Hkv, D]; block_tables [B, MB]; context_lens [B];
// kv_index [Hq] (local KV head of each query head) -> out [B, Hq, D].
// One task per (sequence, KV head): the group's query heads share every K/V row it loads.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale, torch::Tensor kv_index) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32,
              "paged_decode_attention: float32 only");
  q = q.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t MB = block_tables.size(1);
  auto out = torch::zeros_like(q);
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto kvi = kv_index.contiguous();
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* ip = kvi.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t kb_stride = k_cache.stride(0), kt_stride = k_cache.stride(1),
                kh_stride = k_cache.stride(2);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> heads;
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      heads.clear();
      for (int64_t i = 0; i < Hq; ++i)
        if (ip[i] == h) heads.push_back(i);
      const int64_t G = heads.size(), L = lp[b];
      if (G == 0 || L == 0) continue;
      scores.assign(G * L, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t blk = tp[b * MB + t / BS];
        const float* k = kp + blk * kb_stride + (t % BS) * kt_stride + h * kh_stride;
        for (int64_t g = 0; g < G; ++g)
          scores[g * L + t] = dot(qp + (b * Hq + heads[g]) * D, k, D) * (float)scale;
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      for (int64_t t = 0; t < L; ++t) {
        const int64_t blk = tp[b * MB + t / BS];
        const float* v = vp + blk * kb_stride + (t % BS) * kt_stride + h * kh_stride;
        for (int64_t g = 0; g < G; ++g)
          axpy(op + (b * Hq + heads[g]) * D, v, scores[g * L + t], D);
      }
    }
  });
  return out;
}

// residual += x; x = rms_norm(residual) * weight   (both in place, rows in parallel)
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "add_rms_norm_: contiguous float32 only");
  const int64_t H = x.size(-1), N = x.numel() / H;
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * H;
      float* rr = rp + r * H;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) { rr[i] += xr[i]; ss += rr[i] * rr[i]; }
      const float inv = 1.f / std::sqrt(ss / (float)H + (float)eps);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) xr[i] = wp[i] * (rr[i] * inv);
    }
  });
}

// qkv [T, (Hq + 2*Hkv) * D] contiguous: rotate the q and k heads in place (neox halves layout,
// cos/sin [T, D] with duplicated halves), then store k and v rows at their cache slots.
void rotary_write_kv_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t Hq,
                      int64_t Hkv, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor slot_mapping) {
  TORCH_CHECK(qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat32 &&
              cos.is_contiguous() && sin.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "rotary_write_kv_: contiguous float32 only");
  const int64_t T = qkv.size(0), D = cos.size(1), half = D / 2, W = qkv.size(1);
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  auto slots = slot_mapping.contiguous();
  const int64_t* slp = slots.data_ptr<int64_t>();
  const int64_t row = Hkv * D;  // one token's K (or V) in the cache
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* x = xp + t * W;
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < Hq + Hkv; ++h) {
        float* v = x + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = v[i], x2 = v[i + half];
          v[i] = x1 * c[i] + (-x2) * s[i];
          v[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
      std::memcpy(kc + slp[t] * row, x + Hq * D, row * sizeof(float));
      std::memcpy(vc + slp[t] * row, x + (Hq + Hkv) * D, row * sizeof(float));
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_write_kv_", &rotary_write_kv_);
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("add_rms_norm_", &add_rms_norm_);
}
