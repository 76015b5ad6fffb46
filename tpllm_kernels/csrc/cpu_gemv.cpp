// The small-batch linear y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for float32 decode steps.
//
// With a few rows of x the product is bound by streaming W from memory once. MKL's sgemv/sgemm
// stayed well below the memory's bandwidth; this kernel reads each weight row once, in memory
// order, straight into 16-lane FMA accumulators (one per x row; small_m_gemm.h's FmaTile,
// AVX-512 or AVX2), close to a plain read's rate (docs/decisions.md, Decode kernels).
// Every y[m, n] is summed in the same order whatever M and the thread split are: a sequence's
// logits do not depend on what else is in its batch (below the size where the caller switches
// to the GEMM).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "cpu_kernels.h"
#include "small_m_gemm.h"

// x [M, K], weight [N, K], bias [N] or undefined; all float32 and contiguous.
at::Tensor small_m_linear(at::Tensor x, at::Tensor weight,
                             c10::optional<at::Tensor> bias) {
  auto y = at::empty({x.size(0), weight.size(0)}, x.options());
  small_m_linear_into(x, weight, bias, y);
  return y;
}

// The same into y [M, N] (contiguous float32), e.g. a fused decode step's workspace.
void small_m_linear_into(const at::Tensor& x, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_m_linear: x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  x.is_contiguous() && weight.is_contiguous(),
              "small_m_linear: contiguous float32 only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(0) == M &&
              y.size(1) == N, "small_m_linear: y [M, N] contiguous float32");
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  small_m::gemm<small_m::FmaTile>(wp, xp, M, K, N, yp);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
}
