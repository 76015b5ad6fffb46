// The small-batch linear for bfloat16 decode steps, y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// float32 sums rounded to bf16 once at the end. Two tiles, by the module's ISA variant:
//  - AVX512-BF16: pairs of bf16 products summed into fp32 lanes (vdpbf16ps);
//  - AVX2 or AVX-512 without it: each weight row widened to float32 as it is loaded (a shift),
//    16-lane FMAs against x widened once (small_m_gemm.h's FmaTile). Still half of float32's
//    bytes streamed; the widening costs two instructions per 16 weights.
//
// Why: a bf16 batch-1 decode step spent most of its time in oneDNN's GEMV, which repacks each
// weight per call; a decode step must only stream the weights (half the bytes of float32). As
// cpu_gemv.cpp: a weight row at a time x up to 4 input rows, each weight row read once.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "bf16_tile.h"
#include "cpu_kernels.h"
#include "greedy_pick.h"
#include "small_m_gemm.h"

bool bf16_gemv_supported() {
#if defined(__AVX512BF16__) || defined(TPLLM_SIMD16)
  return true;
#else
  return false;
#endif
}

// x [M, K], weight [N, K], bias [N] or undefined: contiguous bfloat16; y in bfloat16.
at::Tensor small_m_linear_bf16(at::Tensor x, at::Tensor weight,
                                  c10::optional<at::Tensor> bias) {
  auto y = at::empty({x.size(0), weight.size(0)}, x.options());
  small_m_linear_bf16_into(x, weight, bias, y);
  return y;
}

// The same into y [M, N] (contiguous bfloat16), e.g. a fused decode step's workspace. The float32
// sums (and x widened, without AVX512-BF16) go through scratch kept per thread, so a decode step
// allocates nothing; y = bf16(sum + bias) rounded once, as torch's y32.add_(bias).to(bf16).
void small_m_linear_bf16_into(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  TORCH_CHECK(bf16_gemv_supported(), "small_m_linear_bf16: needs AVX2 or AVX-512");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_m_linear_bf16: x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  x.is_contiguous() && weight.is_contiguous(),
              "small_m_linear_bf16: contiguous bfloat16 only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == at::kBFloat16 && y.size(0) == M &&
                  y.size(1) == N, "small_m_linear_bf16: y [M, N] contiguous bfloat16");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                            bias->numel() == N), "small_m_linear_bf16: bias [N] bfloat16");
  thread_local std::vector<float> sums, widened;
  sums.resize(M * N);
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
#if defined(__AVX512BF16__)
  small_m::gemm<Bf16Tile>(wp, xp, M, K, N, sums.data());
#elif defined(TPLLM_SIMD16)
  widened.resize(M * K);  // exact; M x K floats, read from L1 by every tile
  for (int64_t i = 0; i < M * K; ++i) widened[i] = small_m::widen(xp[i]);
  small_m::gemm<small_m::FmaTile>(wp, widened.data(), M, K, N, sums.data());
#endif
  const auto* bp = has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const float v = sums[m * N + n];
      yp[m * N + n] = c10::BFloat16(bp ? v + static_cast<float>(bp[n]) : v);
    }
}

// Greedy decoding over a float32 lm_head without reading all of it (ParallelLMHead.argmax_logits):
// every row's argmax of x @ weight^T and that logit, bit for bit what small_m_linear computes
// and argmax picks (the first index among equal maxima), read mostly from `low`, weight's bf16
// copy (half the bytes: a tenth of SmolLM2's decode step).
//   1. approx = x @ low^T in float32 (the bf16 GEMV above, x rounded to bf16 for AVX512-BF16).
//   2. Each approx[n] is within bound[n] = |x| * coef[n] (+ a denormal margin) of the exact
//      logit (Cauchy-Schwarz over the roundings: the caller's coef = eps |w_n|, eps covering x's
//      and the weight's bf16 roundings and both float32 sums). So no index can beat
//      lo = max_n(approx[n] - bound[n]), and only those with approx[n] + bound[n] >= lo can be
//      the exact maximum (every index of a tie included).
//   3. Those (SmolLM2: 1-9 of 49,152) get their exact logit from the float32 row, with the
//      tile small_m_linear runs (each output's sum does not depend on which rows are computed).
// Returns {tokens int64 [B], logits float32 [B], candidates int64 [B]}; tokens -1 where x's row
// is not finite (the caller computes that row in full: the bound assumes finite values).
std::vector<at::Tensor> greedy_argmax_screened(at::Tensor x, at::Tensor weight,
                                                  at::Tensor low, at::Tensor coef) {
  TORCH_CHECK(bf16_gemv_supported(), "greedy_argmax_screened: needs AVX2 or AVX-512");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && low.sizes() == weight.sizes() &&
                  x.size(1) == weight.size(1) && coef.dim() == 1 && coef.size(0) == weight.size(0),
              "greedy_argmax_screened: x [B, K], weight and low [V, K], coef [V]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  low.scalar_type() == at::kBFloat16 &&
                  coef.scalar_type() == at::kFloat && x.is_contiguous() &&
                  weight.is_contiguous() && low.is_contiguous() && coef.is_contiguous(),
              "greedy_argmax_screened: contiguous x, weight, coef float32 and low bf16");
  const int64_t B = x.size(0), K = x.size(1), V = weight.size(0);
  auto approx = at::empty({B, V}, x.options());
  const auto* lp = reinterpret_cast<const uint16_t*>(low.data_ptr());
  float* ap = approx.data_ptr<float>();
#if defined(__AVX512BF16__)
  const auto xb = x.to(at::kBFloat16);
  small_m::gemm<Bf16Tile>(lp, reinterpret_cast<const uint16_t*>(xb.data_ptr()), B, K, V, ap);
#elif defined(TPLLM_SIMD16)
  small_m::gemm<small_m::FmaTile>(lp, x.data_ptr<float>(), B, K, V, ap);
#endif
  return greedy_pick::pick_exact(x.data_ptr<float>(), B, K, V, approx,
                                 greedy_pick::Bound{coef.data_ptr<float>()}, false,
                                 greedy_pick::float_rows(x.data_ptr<float>(),
                                                         weight.data_ptr<float>(), K));
}
