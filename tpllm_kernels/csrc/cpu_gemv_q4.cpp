// The small-batch float32 linear (cpu_gemv.cpp) reading its weight from a 4-bit copy: each
// row in blocks of 32 weights, w = d * q + m (q in [0, 15]; d, m float32 per block), the
// layout of GGUF's Q4_1 (byte j of a block: q of weight j in its low nibble, of j + 16 in its
// high one). tpllm_kernels/cpu_q4.py keeps such a copy only where it reproduces the float32
// weight exactly, as it does for a checkpoint dequantized from Q4_1 (the default model's layers).
//
// Why: a decode step reads every weight once and is bound by memory; the copy is 6 bytes per
// 8 weights instead of 32 (SmolLM2's layers: 80 MB instead of 425).
//
// Same bits as small_m_linear: each block is rebuilt in registers as exactly the float32 weights
// (d * q is exact, one rounding when m is added, as gguf's dequantize computes it), then the
// same 16-lane fused multiply-adds in the same k order into one accumulator per weight row and
// input row, summed as FmaTile sums them.
#include <torch/extension.h>

#include <algorithm>

#include "cpu_kernels.h"
#include "thread_team.h"
#include "vec.h"

namespace {

constexpr int64_t kBlock = 32;

// Input rows a tile of R weight rows takes at once: AVX-512 4 (R x 4 accumulators of its 32
// registers); AVX2 (an F16 is two of its 16 ymm) 1 for 4-row tiles, else 4.
template <int R>
constexpr int inputs() {
#if defined(TPLLM_SIMD16)
  return simd::kRegsPerVec == 1 || R == 1 ? 4 : 1;
#else
  return 4;
#endif
}

// y[m * ldy + r] = x[m] . weight row r (r < R: rows of blocks qs, dm, `bytes` / `scales` apart),
// MM input rows (x stride K). R rows at once: one row's accumulator is a chain of dependent
// FMAs (4 cycles each), which the rebuild's work no longer hides behind memory; R rows are R
// independent chains. Each row's sum is its own, in k order, as in FmaTile.
template <int R, int MM>
void q4_rows(const uint8_t* qs, const float* dm, int64_t bytes, int64_t scales, const float* x,
             int64_t K, float* y, int64_t ldy) {
#if defined(TPLLM_SIMD16)
  using namespace simd;
  F16 acc[R][MM];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = set1(0.f);
  for (int64_t k = 0, b = 0; k < K; k += kBlock, ++b) {
    for (int r = 0; r < R; ++r) {
      F16 lo, hi;
      load_nibbles(qs + r * bytes + b * (kBlock / 2), lo, hi);
      const float* s = dm + r * scales + 2 * b;
      const F16 d = set1(s[0]), mn = set1(s[1]);
      lo = fma(d, lo, mn), hi = fma(d, hi, mn);
      for (int m = 0; m < MM; ++m) {
        acc[r][m] = fma(lo, load(x + m * K + k), acc[r][m]);
        acc[r][m] = fma(hi, load(x + m * K + k + 16), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) y[m * ldy + r] = reduce_add(acc[r][m]);
#else  // portable: multiply then add, as FmaTile's portable form
  v16f acc[R][MM];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = v16f{};
  for (int64_t k = 0, b = 0; k < K; k += kBlock, ++b) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* q = qs + r * bytes + b * (kBlock / 2);
      const float* s = dm + r * scales + 2 * b;
      v16f lo, hi;
      for (int i = 0; i < 16; ++i) {
        lo[i] = s[0] * static_cast<float>(q[i] & 15) + s[1];
        hi[i] = s[0] * static_cast<float>(q[i] >> 4) + s[1];
      }
      for (int m = 0; m < MM; ++m) {
        acc[r][m] = lo * load16(x + m * K + k) + acc[r][m];
        acc[r][m] = hi * load16(x + m * K + k + 16) + acc[r][m];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) y[m * ldy + r] = sum16(acc[r][m]);
#endif
}

// R weight rows x all M inputs, in groups of inputs<R>()
template <int R>
void q4_rows_by_inputs(const uint8_t* qs, const float* dm, int64_t bytes, int64_t scales,
                       const float* x, int64_t M, int64_t K, float* y, int64_t ldy) {
  constexpr int G = inputs<R>();
  int64_t m = 0;
  for (; m + G <= M; m += G) q4_rows<R, G>(qs, dm, bytes, scales, x + m * K, K, y + m * ldy, ldy);
  const int64_t left = M - m;
  if constexpr (G > 3) if (left == 3) q4_rows<R, 3>(qs, dm, bytes, scales, x + m * K, K, y + m * ldy, ldy);
  if constexpr (G > 2) if (left == 2) q4_rows<R, 2>(qs, dm, bytes, scales, x + m * K, K, y + m * ldy, ldy);
  if constexpr (G > 1) if (left == 1) q4_rows<R, 1>(qs, dm, bytes, scales, x + m * K, K, y + m * ldy, ldy);
}

}  // namespace

// x [M, K] float32, q [N, K / 2] uint8, dm [N, K / 32, 2] float32 (d, m of each block), y [M, N]
void small_m_linear_q4_into(const torch::Tensor& x, const torch::Tensor& q,
                            const torch::Tensor& dm, const c10::optional<torch::Tensor>& bias,
                            torch::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "small_m_linear_q4: x [M, K] contiguous float32");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % kBlock == 0 && q.dim() == 2 && q.size(1) == K / 2 &&
                  q.scalar_type() == torch::kUInt8 && q.is_contiguous(),
              "small_m_linear_q4: q [N, K / 2] uint8, K a multiple of 32");
  TORCH_CHECK(dm.dim() == 3 && dm.size(0) == N && dm.size(1) == K / kBlock && dm.size(2) == 2 &&
                  dm.scalar_type() == torch::kFloat32 && dm.is_contiguous(),
              "small_m_linear_q4: dm [N, K / 32, 2] float32");
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == torch::kFloat32 && y.size(0) == M &&
              y.size(1) == N, "small_m_linear_q4: y [M, N] contiguous float32");
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* dp = dm.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // tiles of 4 weight rows; a task is >= ~16 KB of the copy (K * 3 / 4 bytes a row): the
  // rebuild makes a row's work several times its bytes' worth, so tasks are cut finer than the
  // float32 GEMV's 64 KB
  constexpr int64_t kRows = 4;
  const int64_t bytes = K / 2, scales = 2 * (K / kBlock);
  const int64_t tiles = (N + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, 16384 / (kRows * K * 3 / 4));
  team::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kRows, rows = std::min(kRows, N - n0);
      const uint8_t* qn = qp + n0 * bytes;
      const float* dn = dp + n0 * scales;
      if (rows == kRows) {
        q4_rows_by_inputs<kRows>(qn, dn, bytes, scales, xp, M, K, yp + n0, N);
      } else {
        for (int64_t r = 0; r < rows; ++r)
          q4_rows_by_inputs<1>(qn + r * bytes, dn + r * scales, bytes, scales, xp, M, K,
                               yp + n0 + r, N);
      }
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
}
