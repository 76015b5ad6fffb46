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
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

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

#if defined(TPLLM_SIMD16)
// Inputs per pass of greedy_argmax_screened_q8 over the int8 head. AVX-512 takes 8 (its 32
// registers hold 8 accumulators; one pass of 8 beat two passes of 4), AVX2 4.
constexpr int kQ8ScreenInputs = simd::kRegsPerVec == 1 ? 8 : 4;
#else
constexpr int kQ8ScreenInputs = 8;
#endif

int64_t q8_screen_inputs() { return kQ8ScreenInputs; }

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

namespace {

// The next bfloat16 value below v's bf16 rounding (towards -inf): no float32 value under it
// rounds to bf16(v) or above.
float bf16_step_below(float v) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float r = static_cast<float>(c10::BFloat16(v));
  if (std::isnan(r) || r == -kInf) return -kInf;  // no bound below: every index
  uint32_t bits;
  if (r == kInf) {
    bits = 0x7F7F0000u;  // the largest finite bf16: every sum that rounds to inf is above it
  } else {
    std::memcpy(&bits, &r, sizeof(bits));
    if (r == 0.f) bits = 0x80010000u;       // below +-0: the smallest negative bf16
    else if (bits >> 31) bits += 0x10000u;  // negative: one ulp more magnitude
    else bits -= 0x10000u;                  // positive: one ulp less
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Steps 2-3 of the screens below: approx [B, V] is within |x_b| * coef[n] (+ a denormal margin)
// of each exact logit; every index whose bound reaches the best lower bound gets its
// exact logit from exact(b, n) (the head's own GEMV tile: each output's sum does not depend on
// which rows are computed). With round_bf16 the exact logits are the float32 sums rounded to
// bf16, as a bf16 head's linear returns them: every index whose sum can round to the best
// lower bound's bf16 value or above is a candidate (ties are common there), and the first of
// the largest rounded values wins. {tokens, logits, candidates}; tokens -1 for a row that is
// not finite. xf: x's rows in float32 (the bound's |x|).
template <class Exact>
std::vector<at::Tensor> pick_exact(const float* xf, int64_t B, int64_t K, int64_t V,
                                      const at::Tensor& approx, const at::Tensor& coef,
                                      bool round_bf16, Exact exact) {
  const float* ap = approx.data_ptr<float>();
  const float* rn = coef.data_ptr<float>();
  auto tokens = at::full({B}, -1, at::kLong);
  auto values = at::zeros({B}, approx.options());
  auto candidates = at::zeros({B}, at::kLong);
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* vp = values.data_ptr<float>();
  int64_t* cp = candidates.data_ptr<int64_t>();
  // a row per task (verify steps screen up to 8; docs/decisions.md, "The int8 head screen"):
  // a row's passes are serial, so its token does not depend on the split
  team::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* xr = xf + b * K;
      double sq = 0.0;
      for (int64_t k = 0; k < K; ++k) sq += static_cast<double>(xr[k]) * xr[k];
      if (!std::isfinite(sq)) continue;  // inf or NaN somewhere: no bound holds
      // flushed bf16 denormals (vdpbf16ps) err by < K * 2^-126 * max |factor|: far below this
      constexpr double kDenormalMargin = 1e-20;
      const double s = std::sqrt(sq);
      const float* a = ap + b * V;
      double lo = -HUGE_VAL;
      // a max over all indices: any order, the same value (finite x and copies: no NaN)
#pragma omp simd reduction(max : lo)
      for (int64_t n = 0; n < V; ++n) lo = std::max(lo, a[n] - s * rn[n] - kDenormalMargin);
      if (round_bf16) lo = bf16_step_below(static_cast<float>(lo));
      int64_t best = -1, seen = 0;
      float best_value = 0.f;
      for (int64_t n = 0; n < V; ++n) {
        if (a[n] + s * rn[n] + kDenormalMargin < lo) continue;
        float y = exact(b, n);
        if (round_bf16) y = static_cast<float>(c10::BFloat16(y));
        ++seen;
        if (best < 0 || y > best_value) best = n, best_value = y;  // ascending n: first of a tie
      }
      tp[b] = best, vp[b] = best_value, cp[b] = seen;
    }
  });
  return {tokens, values, candidates};
}

#if defined(TPLLM_SIMD16)
// approx of M inputs (x rows K apart) against one int8 head row (q8 screen below): per group of
// 32, (w0 x0 + w1 x1) * scale added to the input's accumulator; M fixed at compile time so the
// accumulators stay in registers. mm < M takes the M - 1 version (a pass's last inputs).
// (Scaling the widened weights once per group, 2 FMAs per input instead of 3 ops, was not kept:
// faster only at 8 rows, slower at the 1-4 rows most steps screen.)
template <int M>
inline void q8_screen_rows(int mm, const int8_t* qr, const float* sr, const float* x, int64_t K,
                           float* out, int64_t V) {
  using namespace simd;
  if constexpr (M > 1) {
    if (mm < M) return q8_screen_rows<M - 1>(mm, qr, sr, x, K, out, V);
  }
  constexpr int64_t kGroup = 32;
  F16 acc[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m] = set1(0.f);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const int64_t k = g * kGroup;
    const F16 w0 = load(qr + k), w1 = load(qr + k + 16), s = set1(sr[g]);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
      acc[m] = fma(fma(w1, load(x + m * K + k + 16), w0 * load(x + m * K + k)), s, acc[m]);
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) out[m * V] = reduce_add(acc[m]);
}
#endif

// float32 head: a row's logit as small_m_linear computes it
auto float_rows(const float* xp, const float* wp, int64_t K) {
  return [=](int64_t b, int64_t n) {
    float y;
    small_m::rows_by_inputs<small_m::FmaTile, 1>(wp + n * K, xp + b * K, 1, K, &y, 1);
    return y;
  };
}

}  // namespace

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
  return pick_exact(x.data_ptr<float>(), B, K, V, approx, coef, false,
                    float_rows(x.data_ptr<float>(), weight.data_ptr<float>(), K));
}

// The same screen from an int8 copy of the head in groups of 32 along K, each with its float32
// scale (a quarter of float32's bytes, plus an eighth for the scales: SmolLM2's head is 32 MB
// instead of the bf16 copy's 57, ~5% of a batch-1 float32 decode step):
//   approx[b, n] = sum_g scales[n, g] * (sum_{k in g} x[b, k] * q[n, k])   (float32 sums)
// and coef[n] (the caller's: |w_n - q_n * scales_n| plus the sums' roundings over the row, see
// backend/model/greedy_head.py) bounds |approx - exact| by |x| * coef[n]. Steps 2-3 as above.
// A bf16 head (x and weight bf16, at most 2 rows: what small_m_linear_bf16 takes) gets the
// logits small_m_linear_bf16 returns: float32 sums of its tile, rounded to bf16.
std::vector<at::Tensor> greedy_argmax_screened_q8(at::Tensor x, at::Tensor weight,
                                                     at::Tensor q, at::Tensor scales,
                                                     at::Tensor coef) {
  TORCH_CHECK(bf16_gemv_supported(), "greedy_argmax_screened_q8: needs AVX2 or AVX-512");
  constexpr int64_t kGroup = 32;
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && q.sizes() == weight.sizes() &&
                  x.size(1) == weight.size(1) && weight.size(1) % kGroup == 0 &&
                  scales.dim() == 2 && scales.size(0) == weight.size(0) &&
                  scales.size(1) == weight.size(1) / kGroup && coef.dim() == 1 &&
                  coef.size(0) == weight.size(0),
              "greedy_argmax_screened_q8: x [B, K], weight and q [V, K] (K a multiple of 32), "
              "scales [V, K / 32], coef [V]");
  const bool bf16_head = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK((weight.scalar_type() == at::kFloat || bf16_head) &&
                  x.scalar_type() == weight.scalar_type() &&
                  q.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat &&
                  coef.scalar_type() == at::kFloat && x.is_contiguous() &&
                  weight.is_contiguous() && q.is_contiguous() && scales.is_contiguous() &&
                  coef.is_contiguous(),
              "greedy_argmax_screened_q8: contiguous x and weight of one dtype (float32 or "
              "bf16), float32 scales and coef, int8 q");
  const int64_t B = x.size(0), K = x.size(1), V = weight.size(0), G = K / kGroup;
  const at::Tensor xf = bf16_head ? x.to(at::kFloat) : x;  // exact
  auto approx = at::empty({B, V}, xf.options());
#if defined(TPLLM_SIMD16)
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* xp = xf.data_ptr<float>();
  float* ap = approx.data_ptr<float>();
  // as small_m::gemm's row-by-row path: each int8 row read once, in memory order, per thread
  // chunk of >= ~64 KB; up to kInputs inputs per pass over the row (more read it again from
  // L1 and widen its int8 again): kQ8ScreenInputs
  constexpr int kInputs = kQ8ScreenInputs;
  // each row first asks for the one small_m::kPrefetchAhead bytes on (and its scales), into L2,
  // as the block-copy GEMV does: the widening and FMAs otherwise keep the loads waiting
  const int64_t ahead = std::max<int64_t>(1, small_m::kPrefetchAhead / K);
  team::parallel_for(0, V, std::max<int64_t>(1, 65536 / K), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      if (n + ahead < V) {
        small_m::prefetch_l2(qp + (n + ahead) * K, K);
        small_m::prefetch_l2(sp + (n + ahead) * G, G * static_cast<int64_t>(sizeof(float)));
      }
      for (int64_t m0 = 0; m0 < B; m0 += kInputs)
        q8_screen_rows<kInputs>(static_cast<int>(std::min<int64_t>(kInputs, B - m0)),
                                qp + n * K, sp + n * G, xp + m0 * K, K, ap + m0 * V + n, V);
    }
  });
#endif
  if (!bf16_head)
    return pick_exact(xf.data_ptr<float>(), B, K, V, approx, coef, false,
                      float_rows(xf.data_ptr<float>(), weight.data_ptr<float>(), K));
  TORCH_CHECK(B <= 2, "greedy_argmax_screened_q8: a bf16 head takes at most 2 rows");
  // a row's logit as small_m_linear_bf16's tile sums it: x in bf16 for AVX512-BF16, else widened
#if defined(__AVX512BF16__)
  using Tile = Bf16Tile;
  const auto* xt = reinterpret_cast<const uint16_t*>(x.data_ptr());
#elif defined(TPLLM_SIMD16)
  using Tile = small_m::FmaTile;
  const float* xt = xf.data_ptr<float>();
#endif
#if defined(TPLLM_SIMD16)
  const auto* wb = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto exact = [=](int64_t b, int64_t n) {
    float y;
    small_m::rows_by_inputs<Tile, 1>(wb + n * K, xt + b * K, 1, K, &y, 1);
    return y;
  };
  return pick_exact(xf.data_ptr<float>(), B, K, V, approx, coef, true, exact);
#else
  return {};  // unreachable: no bf16 GEMV in this build (checked above)
#endif
}
