// The greedy head screen from an int8 copy of the head (greedy_argmax_screened_q8): every row's
// argmax of x @ weight^T and that logit, bit for bit what linear + argmax give, reading mostly
// the int8 copy (SmolLM2: 32 MB instead of the float32 head's 113).
//
// The approximate logits are integer dot products: x is quantized per group of 32 (each group
// scaled to +-127, as the copy's rows are) and each group's 32 int8 x int8 products are summed
// exactly in int32 (AVX512-VNNI vpdpbusd: |x| as the unsigned operand, the copy's codes
// negated where x is negative; AVX-512BW and AVX2: vpmaddubsw + vpmaddwd, which cannot saturate
// at |codes| <= 127), then scaled by both groups' scales in float32. Why: the float32 screen
// widened every code to float (two instructions per 16) and spent three more per 32; integer
// products take about a third of the instructions per byte, and the screen's loads wait less
// behind them (`bench step-parts`' head row; docs/decisions.md, "The int8 head screen
// multiplies integers").
//
// The bound (backend/model/greedy_head.py): with x' the dequantized x,
//   |approx_n - exact_n| <= max(|x|, |x'|) coef[n] + 1.05 |x - x'| wq_norm[n]
// where coef covers the copy's own error and the float32 sums, and wq_norm[n] = |q_n scales_n|:
// the first term as the float32 screen's, the second x's quantization (Cauchy-Schwarz).
// |x - x'| and |x'| are measured in float64 for each step. greedy_pick.h then recomputes in
// float32 every index the bound cannot rule out (SmolLM2: a median of 1 of its 49,152).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_tile.h"
#include "cpu_kernels.h"
#include "greedy_pick.h"
#include "small_m_gemm.h"
#include "thread_team.h"
#include "vec.h"

namespace {

constexpr int64_t kGroup = 32;  // weights per scale, in the copy and in x

#if defined(__AVX512BW__)
// Inputs per pass over the int8 head: one pass of 8 beat two of 4 (docs/decisions.md).
constexpr int kQ8ScreenInputs = 8;
constexpr int64_t kChunk = 64;  // codes per vector: two groups
#elif defined(__AVX2__)
constexpr int kQ8ScreenInputs = 4;
constexpr int64_t kChunk = 32;  // one group
#else
constexpr int kQ8ScreenInputs = 8;
constexpr int64_t kChunk = 32;
#endif

// x's rows quantized for the screen: per group of 32 a float32 scale (its largest magnitude /
// 127) and the nearest codes, kept as |code| (the unsigned operand) and the codes themselves
// (their signs go onto the copy's codes); rows padded to whole chunks with zeros.
struct QuantizedX {
  int64_t chunks = 0, padded = 0;
  std::vector<uint8_t> mag;   // [M, padded]
  std::vector<int8_t> code;   // [M, padded]
  std::vector<float> scale;   // [M, chunks * kChunk / kGroup], 0 for padding groups
  std::vector<double> x_norm, dq_norm, err_norm;  // |x|, |x'| and |x - x'| per row, float64
#if defined(__AVX512BW__)
  std::vector<float> lane_scale;   // [M, chunks, 16]: each int32 lane's group scale
  std::vector<uint64_t> negative;  // [M, chunks]: the chunk's negative codes as a byte mask
#endif

  QuantizedX(const float* x, int64_t M, int64_t K)
      : chunks((K + kChunk - 1) / kChunk), padded(chunks * kChunk),
        mag(M * padded, 0), code(M * padded, 0), scale(M * (padded / kGroup), 0.f),
        x_norm(M, 0.0), dq_norm(M, 0.0), err_norm(M, 0.0) {
    const int64_t G = padded / kGroup;
    for (int64_t m = 0; m < M; ++m) {
      double x2 = 0.0, dq2 = 0.0, err2 = 0.0;
      for (int64_t g = 0; g < K / kGroup; ++g) {
        const float* xg = x + m * K + g * kGroup;
        float amax = 0.f;
        for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(xg[i]));
        // values that are not finite get code 0 (an inf group, scale 0 too): the pick skips
        // such rows (no bound holds); std::max above passes NaNs by, so each value is checked
        const float s = std::isfinite(amax) ? amax / 127.f : 0.f;
        scale[m * G + g] = s;
        for (int64_t i = 0; i < kGroup; ++i) {
          const int64_t at = m * padded + g * kGroup + i;
          const float r = s > 0.f && std::isfinite(xg[i]) ? std::nearbyint(xg[i] / s) : 0.f;
          const int c = static_cast<int>(std::clamp(r, -127.f, 127.f));
          code[at] = static_cast<int8_t>(c);
          mag[at] = static_cast<uint8_t>(c < 0 ? -c : c);
          const double dq = static_cast<double>(c) * s;  // exact in float64
          x2 += static_cast<double>(xg[i]) * xg[i];
          dq2 += dq * dq;
          err2 += (xg[i] - dq) * (xg[i] - dq);
        }
      }
      x_norm[m] = std::sqrt(x2);  // not finite where x is not: the pick skips the row
      dq_norm[m] = std::sqrt(dq2);
      err_norm[m] = std::sqrt(err2);
    }
#if defined(__AVX512BW__)
    lane_scale.resize(M * chunks * 16);
    negative.resize(M * chunks);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < chunks; ++c) {
        for (int j = 0; j < 16; ++j)  // lane j sums codes 4j .. 4j + 3 of the chunk
          lane_scale[(m * chunks + c) * 16 + j] = scale[m * G + (c * kChunk + 4 * j) / kGroup];
        uint64_t bits = 0;
        for (int i = 0; i < kChunk; ++i)
          bits |= static_cast<uint64_t>(code[m * padded + c * kChunk + i] < 0) << i;
        negative[m * chunks + c] = bits;
      }
#endif
  }
};

#if defined(__AVX512BW__)
// approx of M inputs against one head row: per 64 codes, their signs set by x's, the exact
// int32 sums of each 4 products, each group's 8 lanes scaled by copy scale x input scale.
// M fixed at compile time so the accumulators stay in registers; mm < M takes M - 1.
template <int M>
inline void q8_int_rows(int mm, const int8_t* qr, const float* sr, const QuantizedX& xq,
                        int64_t m0, int64_t K, float* out, int64_t V) {
  if constexpr (M > 1) {
    if (mm < M) return q8_int_rows<M - 1>(mm, qr, sr, xq, m0, K, out, V);
  }
  const __m512i two_scales = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  // each input's chunks: rows padded to whole chunks, so chunk c of input m0 + m is at
  // (m0 + m) * chunks + c (pointers hoisted: the loop is a few vector instructions a chunk)
  const int64_t chunks = xq.chunks, whole = K / kChunk;
  const uint8_t* mag[M];
  const uint64_t* neg[M];
  const float* lanes[M];
  __m512 acc[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    const int64_t at = (m0 + m) * chunks;
    mag[m] = xq.mag.data() + at * kChunk;
    neg[m] = xq.negative.data() + at;
    lanes[m] = xq.lane_scale.data() + at * 16;
    acc[m] = _mm512_setzero_ps();
  }
  auto chunk = [&](int64_t c, __m512i q, __m128 s2) {
    const __m512 sw = _mm512_permutexvar_ps(two_scales, _mm512_castps128_ps512(s2));
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512i qs = _mm512_mask_sub_epi8(q, neg[m][c], _mm512_setzero_si512(), q);
      const __m512i xm = _mm512_loadu_si512(mag[m] + c * kChunk);
#if defined(__AVX512VNNI__)
      const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), xm, qs);
#else
      const __m512i d = _mm512_madd_epi16(_mm512_maddubs_epi16(xm, qs), _mm512_set1_epi16(1));
#endif
      const __m512 s = _mm512_mul_ps(sw, _mm512_loadu_ps(lanes[m] + c * 16));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[m]);
    }
  };
  for (int64_t c = 0; c < whole; ++c)  // two groups: both scales
    chunk(c, _mm512_loadu_si512(qr + c * kChunk),
          _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sr + 2 * c))));
  if (whole < chunks)  // one group left: its codes and scale, zeros above
    chunk(whole, _mm512_maskz_loadu_epi8(0xFFFFFFFFull, qr + whole * kChunk),
          _mm_load_ss(sr + 2 * whole));
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) out[m * V] = _mm512_reduce_add_ps(acc[m]);
}
#elif defined(__AVX2__)
// The same with a group per 32-byte vector: vpsignb sets the codes' signs from x's.
template <int M>
inline void q8_int_rows(int mm, const int8_t* qr, const float* sr, const QuantizedX& xq,
                        int64_t m0, int64_t K, float* out, int64_t V) {
  if constexpr (M > 1) {
    if (mm < M) return q8_int_rows<M - 1>(mm, qr, sr, xq, m0, K, out, V);
  }
  const int64_t G = xq.padded / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[M];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + g * kGroup));
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const int64_t row = (m0 + m) * xq.padded + g * kGroup;
      const __m256i xc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.code.data() + row));
      const __m256i xm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.mag.data() + row));
      const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(xm, _mm256_sign_epi8(q, xc)), ones);
      const __m256 s = _mm256_set1_ps(sr[g] * xq.scale[(m0 + m) * G + g]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc[m]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    out[m * V] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
  }
}
#endif

}  // namespace

int64_t q8_screen_inputs() { return kQ8ScreenInputs; }

// A bf16 head (x and weight bf16, at most 2 rows: what small_m_linear_bf16 takes) gets the
// logits small_m_linear_bf16 returns: float32 sums of its tile, rounded to bf16 (greedy_pick.h).
// q: the copy's codes, in [-127, 127] (greedy_head.py's q8_copy makes sure).
std::vector<at::Tensor> greedy_argmax_screened_q8(at::Tensor x, at::Tensor weight,
                                                     at::Tensor q, at::Tensor scales,
                                                     at::Tensor coef, at::Tensor wq_norm) {
  TORCH_CHECK(bf16_gemv_supported(), "greedy_argmax_screened_q8: needs AVX2 or AVX-512");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && q.sizes() == weight.sizes() &&
                  x.size(1) == weight.size(1) && weight.size(1) % kGroup == 0 &&
                  scales.dim() == 2 && scales.size(0) == weight.size(0) &&
                  scales.size(1) == weight.size(1) / kGroup && coef.dim() == 1 &&
                  coef.size(0) == weight.size(0) && wq_norm.sizes() == coef.sizes(),
              "greedy_argmax_screened_q8: x [B, K], weight and q [V, K] (K a multiple of 32), "
              "scales [V, K / 32], coef and wq_norm [V]");
  const bool bf16_head = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK((weight.scalar_type() == at::kFloat || bf16_head) &&
                  x.scalar_type() == weight.scalar_type() &&
                  q.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat &&
                  coef.scalar_type() == at::kFloat && wq_norm.scalar_type() == at::kFloat &&
                  x.is_contiguous() && weight.is_contiguous() && q.is_contiguous() &&
                  scales.is_contiguous() && coef.is_contiguous() && wq_norm.is_contiguous(),
              "greedy_argmax_screened_q8: contiguous x and weight of one dtype (float32 or "
              "bf16), float32 scales, coef and wq_norm, int8 q");
  TORCH_CHECK(!bf16_head || x.size(0) <= 2,
              "greedy_argmax_screened_q8: a bf16 head takes at most 2 rows");
  const int64_t B = x.size(0), K = x.size(1), V = weight.size(0), G = K / kGroup;
  const at::Tensor xf = bf16_head ? x.to(at::kFloat) : x;  // exact
  const float* xp = xf.data_ptr<float>();
  auto approx = at::empty({B, V}, xf.options());
  const QuantizedX xq(xp, B, K);
  std::vector<double> s1(B), s2(B);
  for (int64_t b = 0; b < B; ++b) {
    // a NaN |x| stays NaN here (std::max keeps its first argument): the pick skips the row
    s1[b] = std::max(xq.x_norm[b], xq.dq_norm[b]);
    s2[b] = 1.05 * xq.err_norm[b];
  }
  const greedy_pick::Bound bound{coef.data_ptr<float>(), s1.data(), s2.data(),
                                 wq_norm.data_ptr<float>()};
#if defined(__AVX512BW__) || defined(__AVX2__)
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* ap = approx.data_ptr<float>();
  // Chunks of >= ~64 KB of the copy, each thread's in memory order (one stream), each int8 row
  // read once for up to kQ8ScreenInputs inputs per pass. Each row first asks for the one
  // small_m::kPrefetchAhead bytes on (and its scales) into L2, as the block-copy GEMV does. The
  // chunk's lowest and highest bounds per input go to the pick (greedy_pick::ChunkMax): it then
  // reads the approximations of a chunk or two, not all.
  const int64_t ahead = std::max<int64_t>(1, small_m::kPrefetchAhead / K);
  const int64_t rows = std::max<int64_t>(1, 65536 / K), count = (V + rows - 1) / rows;
  std::vector<double> chunk_lo(B * count), chunk_hi(B * count);
  team::parallel_for(0, count, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * rows, n1 = std::min(V, n0 + rows);
      for (int64_t n = n0; n < n1; ++n) {
        if (n + ahead < V) {
          small_m::prefetch_l2(qp + (n + ahead) * K, K);
          small_m::prefetch_l2(sp + (n + ahead) * G, G * static_cast<int64_t>(sizeof(float)));
        }
        for (int64_t m0 = 0; m0 < B; m0 += kQ8ScreenInputs)
          q8_int_rows<kQ8ScreenInputs>(
              static_cast<int>(std::min<int64_t>(kQ8ScreenInputs, B - m0)), qp + n * K,
              sp + n * G, xq, m0, K, ap + m0 * V + n, V);
      }
      for (int64_t b = 0; b < B; ++b) {
        double lo = -HUGE_VAL, hi = -HUGE_VAL;
        const float* a = ap + b * V;
        for (int64_t n = n0; n < n1; ++n) {
          const double w = bound.width(s1[b], s2[b], n);
          lo = std::max(lo, a[n] - w);
          hi = std::max(hi, a[n] + w);
        }
        chunk_lo[b * count + c] = lo, chunk_hi[b * count + c] = hi;
      }
    }
  });
  const greedy_pick::ChunkMax chunks{rows, count, chunk_lo.data(), chunk_hi.data()};
  if (!bf16_head)
    return greedy_pick::pick_exact(xp, B, K, V, approx, bound, false,
                                   greedy_pick::float_rows(xp, weight.data_ptr<float>(), K),
                                   &chunks);
  // a row's logit as small_m_linear_bf16's tile sums it: x in bf16 for AVX512-BF16, else widened
#if defined(__AVX512BF16__)
  using Tile = Bf16Tile;
  const auto* xt = reinterpret_cast<const uint16_t*>(x.data_ptr());
#else
  using Tile = small_m::FmaTile;
  const float* xt = xp;
#endif
  const auto* wb = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto exact = [=](int64_t b, int64_t n) {
    float y;
    small_m::rows_by_inputs<Tile, 1>(wb + n * K, xt + b * K, 1, K, &y, 1);
    return y;
  };
  return greedy_pick::pick_exact(xp, B, K, V, approx, bound, true, exact, &chunks);
#else
  (void)G, (void)bound, (void)approx;
  return {};  // unreachable: bf16_gemv_supported() is false in this build (checked above)
#endif
}
