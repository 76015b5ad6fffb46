// The exact pick shared by the greedy head screens (cpu_gemv_bf16.cpp's bf16 copy,
// q8_head_screen.cpp's int8 copy): from approximate logits and a bound on their distance to the
// exact ones, the exact argmax and its logit, recomputing only the indices the bound cannot rule
// out (backend/model/greedy_head.py explains the bounds).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "small_m_gemm.h"
#include "thread_team.h"

namespace greedy_pick {

// The next bfloat16 value below v's bf16 rounding (towards -inf): no float32 value under it
// rounds to bf16(v) or above.
inline float bf16_step_below(float v) {
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

// flushed bf16 denormals (vdpbf16ps) err by < K * 2^-126 * max |factor|: far below this
constexpr double kDenormalMargin = 1e-20;

// How far approx[b, n] may be from the exact logit: s1[b] * coef[n] + s2[b] * coef2[n].
// Without s1, s1[b] = |x_b|; without coef2 the second term is 0. A given s1[b] must be
// non-finite wherever x_b is (the pick then skips the row).
struct Bound {
  const float* coef;
  const double* s1 = nullptr;
  const double* s2 = nullptr;
  const float* coef2 = nullptr;

  // the bound of index n for a row whose s1, s2 are s, s2 (+ the denormal margin)
  inline double width(double s, double s2, int64_t n) const {
    return coef2 ? s * coef[n] + s2 * coef2[n] + kDenormalMargin : s * coef[n] + kDenormalMargin;
  }
};

// A screen that tracked, for every chunk of `rows` consecutive indices, each row's largest
// approx - width (lo) and approx + width (hi) as it computed them: the pick then takes the best
// lower bound from the chunks' and scans only the chunks whose hi reaches it, instead of two
// single-threaded passes over the whole vocabulary (lo [B, count], hi [B, count]).
struct ChunkMax {
  int64_t rows = 0, count = 0;
  const double* lo = nullptr;
  const double* hi = nullptr;
};

// Given approx [B, V] within `bound` of each exact logit: every index whose bound reaches the
// best lower bound gets its exact logit from exact(b, n) (the head's own GEMV tile: each
// output's sum does not depend on which rows are computed). With round_bf16 the exact logits are
// the float32 sums rounded to bf16, as a bf16 head's linear returns them: every index whose sum
// can round to the best lower bound's bf16 value or above is a candidate (ties are common there),
// and the first of the largest rounded values wins. {tokens, logits, candidates}; tokens -1 for a
// row that is not finite. xf: x's rows in float32. chunks: the screen's ChunkMax, or null.
template <class Exact>
std::vector<at::Tensor> pick_exact(const float* xf, int64_t B, int64_t K, int64_t V,
                                   const at::Tensor& approx, const Bound& bound, bool round_bf16,
                                   Exact exact, const ChunkMax* chunks = nullptr) {
  const float* ap = approx.data_ptr<float>();
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
      double s;
      if (bound.s1) {
        s = bound.s1[b];
      } else {
        const float* xr = xf + b * K;
        double sq = 0.0;
        for (int64_t k = 0; k < K; ++k) sq += static_cast<double>(xr[k]) * xr[k];
        s = std::sqrt(sq);
      }
      if (!std::isfinite(s)) continue;  // inf or NaN somewhere: no bound holds
      const double s2 = bound.s2 ? bound.s2[b] : 0.0;
      const float* a = ap + b * V;
      double lo = -HUGE_VAL;
      // a max over all indices: any order, the same value (finite x and copies: no NaN)
      if (chunks) {
        for (int64_t c = 0; c < chunks->count; ++c) lo = std::max(lo, chunks->lo[b * chunks->count + c]);
      } else {
#pragma omp simd reduction(max : lo)
        for (int64_t n = 0; n < V; ++n) lo = std::max(lo, a[n] - bound.width(s, s2, n));
      }
      if (round_bf16) lo = bf16_step_below(static_cast<float>(lo));
      int64_t best = -1, seen = 0;
      float best_value = 0.f;
      auto scan = [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          if (a[n] + bound.width(s, s2, n) < lo) continue;
          float y = exact(b, n);
          if (round_bf16) y = static_cast<float>(c10::BFloat16(y));
          ++seen;
          if (best < 0 || y > best_value) best = n, best_value = y;  // ascending n: first of a tie
        }
      };
      if (chunks) {
        for (int64_t c = 0; c < chunks->count; ++c)
          if (chunks->hi[b * chunks->count + c] >= lo)
            scan(c * chunks->rows, std::min(V, (c + 1) * chunks->rows));
      } else {
        scan(0, V);
      }
      tp[b] = best, vp[b] = best_value, cp[b] = seen;
    }
  });
  return {tokens, values, candidates};
}

// float32 head: a row's logit as small_m_linear computes it
inline auto float_rows(const float* xp, const float* wp, int64_t K) {
  return [=](int64_t b, int64_t n) {
    float y;
    small_m::rows_by_inputs<small_m::FmaTile, 1>(wp + n * K, xp + b * K, 1, K, &y, 1);
    return y;
  };
}

}  // namespace greedy_pick
