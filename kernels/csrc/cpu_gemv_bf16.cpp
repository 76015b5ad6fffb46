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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "cpu_kernels.h"
#include "small_m_gemm.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

struct Bf16Tile {
  template <int R>
  static constexpr int inputs() { return 4; }
  template <int R, int MM>
  static void run(const uint16_t* w, const uint16_t* x, int64_t K, float* y, int64_t ldy) {
    __m512 acc[R][MM];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_setzero_ps();
    const int64_t kv = K - K % 32;
    for (int64_t k = 0; k < kv; k += 32) {
      __m512bh xs[MM];
      for (int m = 0; m < MM; ++m) xs[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * K + k);
        for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xs[m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MM; ++m) {
        float s = _mm512_reduce_add_ps(acc[r][m]);
        for (int64_t k = kv; k < K; ++k)
          s += small_m::widen(w[r * K + k]) * small_m::widen(x[m * K + k]);
        y[m * ldy + r] = s;
      }
  }
};

}  // namespace
#endif

bool bf16_gemv_supported() {
#if defined(__AVX512BF16__) || defined(TPLLM_SIMD16)
  return true;
#else
  return false;
#endif
}

// x [M, K], weight [N, K], bias [N] or undefined: contiguous bfloat16; y in bfloat16.
torch::Tensor small_m_linear_bf16(torch::Tensor x, torch::Tensor weight,
                                  c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(bf16_gemv_supported(), "small_m_linear_bf16: needs AVX2 or AVX-512");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_m_linear_bf16: x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16 &&
                  x.is_contiguous() && weight.is_contiguous(),
              "small_m_linear_bf16: contiguous bfloat16 only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  float* yp = y.data_ptr<float>();
#if defined(__AVX512BF16__)
  small_m::gemm<Bf16Tile>(wp, reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, N, yp);
#elif defined(TPLLM_SIMD16)
  const auto xf = x.to(torch::kFloat32);  // exact; M x K floats, read from L1 by every tile
  small_m::gemm<small_m::FmaTile>(wp, xf.data_ptr<float>(), M, K, N, yp);
#endif
  if (bias.has_value() && bias->defined()) y.add_(*bias);  // in fp32, one rounding below
  return y.to(torch::kBFloat16);
}
