// The small-batch linear y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for float32 decode steps.
//
// With a few rows of x the product is bound by streaming W from memory once. MKL's sgemv/sgemm
// for M = 1 reached ~21.5 GB/s with 2 threads on this VM (SmolLM2's 121 decode GEMVs: 24.5 ms);
// this kernel reads 4 weight rows at a time, each once, straight into 16-lane FMA accumulators
// (one per weight row and x row) and reaches ~26 GB/s (20.6 ms); with 1 thread 40 vs 45 ms.
// Every y[m, n] is summed in the same order whatever M and the thread split are: a sequence's
// logits do not depend on what else is in its batch (below the size where the caller switches
// to the GEMM).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"
#include "small_m_gemm.h"
#include "vec.h"

namespace {

inline v16f fma16(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);  // explicit: the module builds with -ffp-contract=off
#else
  return a * b + c;
#endif
}

// R weight rows (w, stride K) x MM input rows (x, stride K) -> y[m * ldy + r]
struct Fp32Tile {
  template <int R, int MM>
  static void run(const float* w, const float* x, int64_t K, float* y, int64_t ldy) {
    v16f acc[R][MM];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MM; ++m) acc[r][m] = v16f{};
    const int64_t kv = K - K % 16;
    for (int64_t k = 0; k < kv; k += 16) {
      v16f xs[MM];
      for (int m = 0; m < MM; ++m) xs[m] = load16(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        const v16f wv = load16(w + r * K + k);
        for (int m = 0; m < MM; ++m) acc[r][m] = fma16(wv, xs[m], acc[r][m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MM; ++m) {
        float s = sum16(acc[r][m]);
        for (int64_t k = kv; k < K; ++k) s += w[r * K + k] * x[m * K + k];
        y[m * ldy + r] = s;
      }
  }
};

}  // namespace

// x [M, K], weight [N, K], bias [N] or undefined; all float32 and contiguous.
torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor weight,
                             c10::optional<torch::Tensor> bias) {
  auto y = torch::empty({x.size(0), weight.size(0)}, x.options());
  small_m_linear_into(x, weight, bias, y);
  return y;
}

// The same into y [M, N] (contiguous float32), e.g. a fused decode step's workspace.
void small_m_linear_into(const torch::Tensor& x, const torch::Tensor& weight,
                         const c10::optional<torch::Tensor>& bias, torch::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_m_linear: x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32 &&
                  x.is_contiguous() && weight.is_contiguous(),
              "small_m_linear: contiguous float32 only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == torch::kFloat32 && y.size(0) == M &&
              y.size(1) == N, "small_m_linear: y [M, N] contiguous float32");
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  small_m::gemm<Fp32Tile>(wp, xp, M, K, N, yp);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
}
