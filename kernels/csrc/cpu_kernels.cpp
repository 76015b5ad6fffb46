// Fused CPU kernels for the decode-heavy path, where torch's per-op dispatch and the paged-KV
// gather (copy, then attend) cost more than the arithmetic. Storage float32 or bfloat16 (the
// AMX path); arithmetic always float32. Every function has a torch reference in
// kernels/reference.py that the tests compare against.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

template <typename T>
inline void axpy(float* y, const T* x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * static_cast<float>(x[i]);
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

void check_storage(const torch::Tensor& t, const char* fn) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, fn,
              ": float32 or bfloat16 only");
}

template <typename T>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& tables,
                           const torch::Tensor& lens, double scale, const torch::Tensor& kvi,
                           torch::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t MB = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* ip = kvi.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t kb_stride = k_cache.stride(0), kt_stride = k_cache.stride(1),
                kh_stride = k_cache.stride(2);
  const float fscale = (float)scale;
  // One task per (sequence, KV head): the group's query heads share every K/V row it loads.
  // Block by block (online softmax): the block's K/V rows are converted to fp32 once into
  // L1-resident buffers, then every query head of the group reads them.
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> heads;
    std::vector<float> qf, acc, kb(BS * D), vb(BS * D), sc, mx, den;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      heads.clear();
      for (int64_t i = 0; i < Hq; ++i)
        if (ip[i] == h) heads.push_back(i);
      const int64_t G = heads.size(), L = lp[b];
      if (G == 0) continue;
      acc.assign(G * D, 0.f);
      qf.resize(G * D);
      sc.resize(G * BS);
      mx.assign(G, -INFINITY);
      den.assign(G, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < D; ++i)
          qf[g * D + i] = static_cast<float>(qp[(b * Hq + heads[g]) * D + i]);
      for (int64_t start = 0; start < L; start += BS) {
        const int64_t n = std::min(BS, L - start);
        const int64_t blk = tp[b * MB + start / BS];
        const T* kbase = kp + blk * kb_stride + h * kh_stride;
        const T* vbase = vp + blk * kb_stride + h * kh_stride;
        for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) {
            kb[j * D + i] = static_cast<float>(kbase[j * kt_stride + i]);
            vb[j * D + i] = static_cast<float>(vbase[j * kt_stride + i]);
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* s = sc.data() + g * BS;
          float m = mx[g];
          for (int64_t j = 0; j < n; ++j) {
            s[j] = dot(qf.data() + g * D, kb.data() + j * D, D) * fscale;
            m = std::max(m, s[j]);
          }
          const float corr = std::exp(mx[g] - m);  // 0 on the first block (acc is still 0)
          mx[g] = m;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < n; ++j) { s[j] = exp_nonpositive(s[j] - m); sum += s[j]; }
          den[g] = den[g] * corr + sum;
          float* a = acc.data() + g * D;
          if (corr != 1.f) {
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) a[i] *= corr;
          }
          for (int64_t j = 0; j < n; ++j) axpy(a, vb.data() + j * D, s[j], D);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = L > 0 ? 1.f / den[g] : 0.f;
        for (int64_t i = 0; i < D; ++i)
          op[(b * Hq + heads[g]) * D + i] = static_cast<T>(acc[g * D + i] * inv);
      }
    }
  });
}

template <typename T>
void add_rms_norm_impl(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                       double eps) {
  const int64_t H = x.size(-1), N = x.numel() / H;
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> r(H);
    for (int64_t row = begin; row < end; ++row) {
      T* xr = xp + row * H;
      T* rr = rp + row * H;
      float ss = 0.f;
      // The sum is stored at storage precision first, as torch's `residual + x` does.
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) {
        const T sum = static_cast<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
        rr[i] = sum;
        r[i] = static_cast<float>(sum);
        ss += r[i] * r[i];
      }
      const float inv = 1.f / std::sqrt(ss / (float)H + (float)eps);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) xr[i] = static_cast<T>(static_cast<float>(wp[i]) * (r[i] * inv));
    }
  });
}

template <typename T>
void rotary_write_kv_impl(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          int64_t Hq, int64_t Hkv, torch::Tensor& k_cache, torch::Tensor& v_cache,
                          const torch::Tensor& slots) {
  const int64_t T_ = qkv.size(0), D = cos.size(1), half = D / 2, W = qkv.size(1);
  T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t* slp = slots.data_ptr<int64_t>();
  const int64_t row = Hkv * D;  // one token's K (or V) in the cache
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* x = xp + t * W;
      const T* c = cp + t * D;
      const T* s = sp + t * D;
      for (int64_t h = 0; h < Hq + Hkv; ++h) {
        T* v = x + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[i + half]);
          // Each product rounded to storage precision before the sum, like the torch reference.
          const float a1 = static_cast<float>(static_cast<T>(x1 * static_cast<float>(c[i])));
          const float b1 = static_cast<float>(static_cast<T>((-x2) * static_cast<float>(s[i])));
          const float a2 = static_cast<float>(static_cast<T>(x2 * static_cast<float>(c[i + half])));
          const float b2 = static_cast<float>(static_cast<T>(x1 * static_cast<float>(s[i + half])));
          v[i] = static_cast<T>(a1 + b1);
          v[i + half] = static_cast<T>(a2 + b2);
        }
      }
      std::memcpy(kc + slp[t] * row, x + Hq * D, row * sizeof(T));
      std::memcpy(vc + slp[t] * row, x + (Hq + Hkv) * D, row * sizeof(T));
    }
  });
}

}  // namespace

// q [B, Hq, D]; caches [NB, BS, Hkv, D]; block_tables [B, MB]; context_lens [B];
// kv_index [Hq] (local KV head of each query head) -> out [B, Hq, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale, torch::Tensor kv_index) {
  check_storage(q, "paged_decode_attention");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_decode_attention: q and the caches must share a dtype");
  q = q.contiguous();
  auto out = torch::empty_like(q);
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto kvi = kv_index.contiguous();
  if (q.scalar_type() == torch::kBFloat16)
    decode_attention_impl<bf16>(q, k_cache, v_cache, tables, lens, scale, kvi, out);
  else
    decode_attention_impl<float>(q, k_cache, v_cache, tables, lens, scale, kvi, out);
  return out;
}

// residual += x; x = rms_norm(residual) * weight   (both in place, rows in parallel)
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_storage(x, "add_rms_norm_");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() &&
              residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm_: contiguous tensors of one dtype only");
  if (x.scalar_type() == torch::kBFloat16)
    add_rms_norm_impl<bf16>(x, residual, weight, eps);
  else
    add_rms_norm_impl<float>(x, residual, weight, eps);
}

// qkv [T, (Hq + 2*Hkv) * D] contiguous: rotate the q and k heads in place (neox halves layout,
// cos/sin [T, D] with duplicated halves), then store k and v rows at their cache slots.
void rotary_write_kv_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t Hq,
                      int64_t Hkv, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor slot_mapping) {
  check_storage(qkv, "rotary_write_kv_");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
              k_cache.is_contiguous() && v_cache.is_contiguous(),
              "rotary_write_kv_: contiguous tensors only");
  for (const auto* t : {&cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "rotary_write_kv_: one dtype only");
  auto slots = slot_mapping.contiguous();
  if (qkv.scalar_type() == torch::kBFloat16)
    rotary_write_kv_impl<bf16>(qkv, cos, sin, Hq, Hkv, k_cache, v_cache, slots);
  else
    rotary_write_kv_impl<float>(qkv, cos, sin, Hq, Hkv, k_cache, v_cache, slots);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_write_kv_", &rotary_write_kv_);
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("add_rms_norm_", &add_rms_norm_);
}
