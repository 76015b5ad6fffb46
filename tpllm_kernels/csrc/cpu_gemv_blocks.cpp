// The small-batch float32 linear (cpu_gemv.cpp) reading its weight from an exact block copy
// (tpllm_kernels/cpu_blocks.py keeps one only where it rebuilds the float32 weight bit for bit):
//  - Q4: blocks of 32 weights along a row, w = d * q + m (q in [0, 15]; d, m float32 per
//    block), the layout of GGUF's Q4_1 (byte j of a block: q of weight j in its low nibble, of
//    j + 16 in its high one): the default model's layers, 6 bytes per 8 weights.
//  - Q8: blocks of 32, w = s * q (q int8, s float32 per block), GGUF's Q8_0: the default
//    model's tied embedding, i.e. its lm_head, 9 bytes per 8 weights.
//
// Why: a decode step reads every weight once and is bound by memory; the copies read a sixth
// (Q4) or a quarter (Q8) of float32's bytes.
//
// Same bits as small_m_linear: each block is rebuilt in registers as exactly the float32
// weights (d * q and s * q are exact in float32: checked at load; one rounding when m is
// added, as gguf's dequantize computes it), then the same 16-lane fused multiply-adds in the
// same k order into one accumulator per weight row and input row, summed as FmaTile sums them.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#include "cpu_kernels.h"
#include "small_m_gemm.h"
#include "thread_team.h"
#include "vec.h"

namespace {

constexpr int64_t kBlock = 32;

#if defined(TPLLM_SIMD16)
using Block16 = simd::F16;
#else
using Block16 = v16f;
#endif

// A block's 32 weights as two 16-lane vectors (lo: weights 0-15, hi: 16-31)
struct Q4 {
  static constexpr int64_t kBytes = kBlock / 2, kScales = 2;  // per block
  static void rebuild(const uint8_t* q, const float* s, Block16& lo, Block16& hi) {
#if defined(TPLLM_SIMD16)
    using namespace simd;
    rebuild_q4(q, s[0], s[1], lo, hi);
#else
    for (int i = 0; i < 16; ++i) {
      lo[i] = s[0] * static_cast<float>(q[i] & 15) + s[1];
      hi[i] = s[0] * static_cast<float>(q[i] >> 4) + s[1];
    }
#endif
  }
};

struct Q8 {
  static constexpr int64_t kBytes = kBlock, kScales = 1;
  static void rebuild(const uint8_t* q, const float* s, Block16& lo, Block16& hi) {
    const int8_t* c = reinterpret_cast<const int8_t*>(q);
#if defined(TPLLM_SIMD16)
    using namespace simd;
    const F16 d = set1(s[0]);
    lo = load(c) * d, hi = load(c + 16) * d;
#else
    for (int i = 0; i < 16; ++i) {
      lo[i] = static_cast<float>(c[i]) * s[0];
      hi[i] = static_cast<float>(c[i + 16]) * s[0];
    }
#endif
  }
};

// Input rows a tile of R weight rows takes at once: AVX-512 4 (R x 4 accumulators of its 32
// registers), or 8 for 2-row tiles (5+ inputs: each block is rebuilt once per 8 inputs instead
// of once per 4); AVX2 (an F16 is two of its 16 ymm) 1 for 4-row tiles, else 4.
template <int R>
constexpr int inputs() {
#if defined(TPLLM_SIMD16)
  if (simd::kRegsPerVec == 1) return R == 2 ? 8 : 4;
  return R == 1 ? 4 : 1;
#else
  return 4;
#endif
}

// y[m * ldy + r] = x[m] . weight row r (r < R: rows of blocks q, s, `bytes` / `scales` apart),
// MM input rows (x stride K). R rows at once: one row's accumulator is a chain of dependent
// FMAs (4 cycles each), which the rebuild's work no longer hides behind memory; R rows are R
// independent chains. Each row's sum is its own, in k order, as in FmaTile.
template <class Codes, int R, int MM>
void block_rows(const uint8_t* q, const float* s, int64_t bytes, int64_t scales, const float* x,
                int64_t K, float* y, int64_t ldy) {
  Block16 acc[R][MM];
#if defined(TPLLM_SIMD16)
  using namespace simd;
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = set1(0.f);
  for (int64_t k = 0, b = 0; k < K; k += kBlock, ++b) {
    for (int r = 0; r < R; ++r) {
      F16 lo, hi;
      Codes::rebuild(q + r * bytes + b * Codes::kBytes, s + r * scales + b * Codes::kScales, lo,
                     hi);
      for (int m = 0; m < MM; ++m) {
        acc[r][m] = fma(lo, load(x + m * K + k), acc[r][m]);
        acc[r][m] = fma(hi, load(x + m * K + k + 16), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) y[m * ldy + r] = reduce_add(acc[r][m]);
#else  // portable: multiply then add, as FmaTile's portable form
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = v16f{};
  for (int64_t k = 0, b = 0; k < K; k += kBlock, ++b) {
    for (int r = 0; r < R; ++r) {
      v16f lo, hi;
      Codes::rebuild(q + r * bytes + b * Codes::kBytes, s + r * scales + b * Codes::kScales, lo,
                     hi);
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

// R weight rows x all M inputs, in groups of inputs<R>(), then the M % G left as one group
template <class Codes, int R>
void rows_by_inputs(const uint8_t* q, const float* s, int64_t bytes, int64_t scales,
                    const float* x, int64_t M, int64_t K, float* y, int64_t ldy) {
  constexpr int G = inputs<R>();
  auto run = [&](auto mm, int64_t m) {
    block_rows<Codes, R, decltype(mm)::value>(q, s, bytes, scales, x + m * K, K, y + m * ldy,
                                              ldy);
  };
  int64_t m = 0;
  for (; m + G <= M; m += G) run(std::integral_constant<int, G>{}, m);
  const int64_t left = M - m;
  if constexpr (G > 7) if (left == 7) run(std::integral_constant<int, 7>{}, m);
  if constexpr (G > 6) if (left == 6) run(std::integral_constant<int, 6>{}, m);
  if constexpr (G > 5) if (left == 5) run(std::integral_constant<int, 5>{}, m);
  if constexpr (G > 4) if (left == 4) run(std::integral_constant<int, 4>{}, m);
  if constexpr (G > 3) if (left == 3) run(std::integral_constant<int, 3>{}, m);
  if constexpr (G > 2) if (left == 2) run(std::integral_constant<int, 2>{}, m);
  if constexpr (G > 1) if (left == 1) run(std::integral_constant<int, 1>{}, m);
}

// x [M, K] float32, q [N, K / 32 * Codes::kBytes] (uint8 or int8), s [N, K / 32 * kScales]
// float32 (any shape of that many), y [M, N]
template <class Codes>
void linear_into(const char* name, const at::Tensor& x, const at::Tensor& q,
                 const at::Tensor& s, const c10::optional<at::Tensor>& bias,
                 at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              ": x [M, K] contiguous float32");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  const int64_t bytes = K / kBlock * Codes::kBytes, scales = K / kBlock * Codes::kScales;
  TORCH_CHECK(K > 0 && K % kBlock == 0 && q.dim() == 2 && q.size(1) == bytes &&
                  q.element_size() == 1 && q.is_contiguous(),
              name, ": codes [N, K / 32 * ", Codes::kBytes,
              "] bytes, K a positive multiple of 32");
  TORCH_CHECK(s.size(0) == N && s.numel() == N * scales && s.scalar_type() == at::kFloat &&
                  s.is_contiguous(), name, ": scales [N, K / 32 * ", Codes::kScales, "] float32");
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(0) == M &&
              y.size(1) == N, name, ": y [M, N] contiguous float32");
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // tiles of 4 weight rows (AVX-512 with 5+ inputs: as two 2-row tiles of 8 inputs; AVX2 with
  // 2+ inputs: a row at a time with 4 inputs, whose 4 chains are as independent, rather than
  // 4-row tiles of one input, which rebuild each block once per input); a task is >= ~16 KB of the copy: the rebuild makes a row's work
  // several times its bytes' worth, so tasks are cut finer than the float32 GEMV's 64 KB
  constexpr int64_t kRows = 4;
  const int64_t tiles = (N + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, 16384 / (kRows * (bytes + 4 * scales)));
  // Each tile first asks for the codes kPrefetchAhead bytes on (and the scales as far on in
  // rows), into L2. Without it the rebuild's instructions fill the out-of-order window and the
  // loads wait on DRAM: one input row's GEMVs read the copies at a third of the bandwidth a
  // plain read reaches (docs/decisions.md, "The block-copy GEMV and the int8 head screen
  // prefetch").
  const char* q_end = reinterpret_cast<const char*>(qp + N * bytes);
  const char* s_end = reinterpret_cast<const char*>(sp + N * scales);
  constexpr int64_t kAhead = small_m::kPrefetchAhead;
  const int64_t s_ahead = kAhead / bytes * scales * static_cast<int64_t>(sizeof(float));
  team::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kRows, rows = std::min(kRows, N - n0);
      const uint8_t* qn = qp + n0 * bytes;
      const float* sn = sp + n0 * scales;
      const char* pq = reinterpret_cast<const char*>(qn) + kAhead;
      if (pq < q_end) small_m::prefetch_l2(pq, std::min<int64_t>(rows * bytes, q_end - pq));
      const char* ps = reinterpret_cast<const char*>(sn) + s_ahead;
      if (ps < s_end)
        small_m::prefetch_l2(ps, std::min<int64_t>(rows * scales * 4, s_end - ps));
      if (rows == kRows && M > inputs<kRows>() && inputs<2>() > inputs<kRows>()) {
        for (int64_t r = 0; r < kRows; r += 2)
          rows_by_inputs<Codes, 2>(qn + r * bytes, sn + r * scales, bytes, scales, xp, M, K,
                                   yp + n0 + r, N);
      } else if (rows == kRows && (M == 1 || inputs<kRows>() > 1)) {
        rows_by_inputs<Codes, kRows>(qn, sn, bytes, scales, xp, M, K, yp + n0, N);
      } else {
        for (int64_t r = 0; r < rows; ++r)
          rows_by_inputs<Codes, 1>(qn + r * bytes, sn + r * scales, bytes, scales, xp, M, K,
                                   yp + n0 + r, N);
      }
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
}

}  // namespace

// The most input rows for which the float32 linear reads the copy rather than the weight: the
// rebuild is paid once per 4 inputs (AVX-512) or per input (AVX2), and from 32 rows on AVX2
// the float32 GEMV was as fast, while AVX-512 stays ahead at 64 (docs/decisions.md, "Exact
// GGUF block copies")
int64_t block_copy_max_rows() {
#if defined(TPLLM_SIMD16)
  return simd::kRegsPerVec == 1 ? INT64_MAX : 16;
#else
  return INT64_MAX;
#endif
}

void small_m_linear_q4_into(const at::Tensor& x, const at::Tensor& q,
                            const at::Tensor& dm, const c10::optional<at::Tensor>& bias,
                            at::Tensor& y) {
  linear_into<Q4>("small_m_linear_q4", x, q, dm, bias, y);
}

void small_m_linear_q8_into(const at::Tensor& x, const at::Tensor& q,
                            const at::Tensor& scales, const c10::optional<at::Tensor>& bias,
                            at::Tensor& y) {
  linear_into<Q8>("small_m_linear_q8", x, q, scales, bias, y);
}
