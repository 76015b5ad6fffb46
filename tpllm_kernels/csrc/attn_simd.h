// The decode attention for head_dim 64 over the paged cache, written once against simd::F16
// (vec.h: AVX-512, or AVX2 + FMA as two registers per vector), for float32 or bfloat16 caches
// (bf16 rows widened as they are loaded), and the softmax row the prefill attention shares.
//
// Why: the portable block step (decode_attention.cpp, block_group_fast) sums each token's score
// with its own 16-lane horizontal reduction and runs the softmax in scalar code: about twice the
// time its KV bytes take to stream.
// Here 16 tokens' partial dot products are transposed and summed together (a few shuffles and
// adds instead of 16 reductions), and max, exp and sum run on whole vectors.
#pragma once
#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace attn {

// A decode task's options beyond its block range: a sliding window's first token (for every
// head, or per head where one task carries several rows of a sequence), per-head lengths (those
// rows' own), and the logit soft-cap (0: none).
struct KeyLimits {
  int64_t start = 0;                    // the first token every head sees
  const int64_t* head_start = nullptr;  // per head, overriding start
  const int64_t* head_len = nullptr;    // per head: tokens [0, head_len[h]) at most
  float softcap = 0.f;
};

// The first key a query at absolute position pos sees under a sliding window of `window` keys
// (itself included; 0: no window): transformers' kv_idx > q_idx - sliding_window.
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0;
}

// tanh as a rational function, odd, clamped where it reaches +-1 in float32 (Eigen's float
// tanh, a few ulp): vectorizable, where std::tanh is a libm call per score. Plain multiply-adds:
// the portable path's form of simd::tanh_rational (the same values up to the FMAs' rounding).
inline float tanh_rational(float x) {
  x = std::clamp(x, -7.90531110763549805f, 7.90531110763549805f);
  const float x2 = x * x;
  float p = -2.76076847742355e-16f;
  for (const float c : {2.00018790482477e-13f, -8.60467152213735e-11f, 5.12229709037114e-08f,
                        1.48572235717979e-05f, 6.37261928875436e-04f, 4.89352455891786e-03f})
    p = p * x2 + c;
  float q = 1.19825839466702e-06f;
  for (const float c : {1.18534705686654e-04f, 2.26843463243900e-03f, 4.89352518554385e-03f})
    q = q * x2 + c;
  return x * p / q;
}

// Gemma 2's attention logit soft-cap on scores s[0, n), in place: s = cap * tanh(s / cap)
inline void softcap_scores(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] = cap * tanh_rational(s[j] * inv);
}

}  // namespace attn

#if defined(TPLLM_SIMD16)
#include <atomic>
#include <cmath>
#include <vector>

namespace simd {

// Reads one byte of every cache line of p[0, n) in address order. The block loops below read a
// block head by head (rows `row` apart, a head's 64 columns each), an order the hardware
// prefetchers do not follow; touching the block in order first streams it at close to a plain
// read's rate, about twice the head-by-head rate (docs/decisions.md, "Decode attention touches
// each K/V block in address order first"). That was an AMD Zen 4; on the Intel Xeon measured
// (AVX-512 + AMX) the pass slowed the attention instead (`bench step-parts`; "...except on
// Intel CPUs"), so it is switched per CPU vendor at load (cpu_ops.py,
// set_attention_touch_pass; the same bits either way).
extern std::atomic<bool> g_attention_touch_pass;

template <typename T>
inline void touch_lines(const T* p, int64_t n) {
  const volatile char* c = reinterpret_cast<const volatile char*>(p);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < bytes; i += 64) (void)c[i];
}

// Prefetches one KV block into L2 a few cache lines at a time, spread over the compute of the
// block before it. Why spread, and why L2: a block's 192 prefetches issued at once (into L1, two
// blocks ahead) wait on the core's few outstanding misses before any arithmetic runs, and a
// 32 KB L1 cannot hold the block being read plus two 12 KB blocks in flight. Spread into L1, or
// into L2 three or four blocks ahead, or (Zen 4) without the in-order touch pass were all
// slower, with the same bits out (docs/decisions.md, "...and prefetches the block two ahead").
struct SpreadPrefetch {
  const char* next = nullptr;
  int64_t lines_left = 0;
  void start(const void* block, int64_t lines) {
    next = static_cast<const char*>(block);
    lines_left = lines;
  }
  inline void step(int64_t lines) {
    for (lines = std::min(lines, lines_left); lines > 0; --lines, --lines_left, next += 64)
      __builtin_prefetch(next, 0, 2);  // _MM_HINT_T1: to L2
  }
  void finish() { step(lines_left); }
};

struct SoftmaxRow {
  float max, sum;
};

// lanes [m, 16) of a, `fill` in lanes [0, m) (m may be outside [0, 16])
inline F16 from_lane(F16 a, int64_t m, float fill) {
  alignas(64) static const float kIota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const float mf = static_cast<float>(std::clamp<int64_t>(m, 0, 16));
  return where_nonnegative(load(kIota) - set1(mf), a, set1(fill));
}

// Scores s[start, limit) -> exp(s - max) in place, zeros on [0, start) and [limit, n) (n a
// multiple of 16): the unnormalised probabilities of one row, with its max and sum (decode
// keeps both to merge splits; prefill divides by the sum). start > 0: a sliding window's
// first key. The chunks before it have loops of their own (the same order of sums), so the
// others run exactly the unwindowed loops.
inline SoftmaxRow softmax_row(float* s, int64_t limit, int64_t n, int64_t start = 0) {
  auto left = [limit](int64_t k) { return static_cast<int>(std::clamp<int64_t>(limit - k, 0, 16)); };
  const int64_t head = std::clamp<int64_t>((start + 15) / 16 * 16, 0, n);  // chunks before start
  F16 m = set1(-INFINITY);
  for (int64_t k = 0; k < head; k += 16)
    m = max(m, from_lane(first(load(s + k), left(k), -INFINITY), start - k, -INFINITY));
  for (int64_t k = head; k < n; k += 16) m = max(m, first(load(s + k), left(k), -INFINITY));
  const float mx = reduce_max(m);
  const F16 mv = set1(mx);
  F16 sum = set1(0.f);
  for (int64_t k = 0; k < head; k += 16) {
    const F16 p = from_lane(first(exp_nonpositive(load(s + k) - mv), left(k), 0.f), start - k, 0.f);
    store(s + k, p);
    sum = sum + p;
  }
  for (int64_t k = head; k < n; k += 16) {
    const F16 p = first(exp_nonpositive(load(s + k) - mv), left(k), 0.f);
    store(s + k, p);
    sum = sum + p;
  }
  return {mx, reduce_add(sum)};
}

// attn::tanh_rational on 16 lanes, with FMAs: the same operations on every ISA variant (the
// clamp's upper side a blend, F16 having no min)
inline F16 tanh_rational(F16 x) {
  const float c = 7.90531110763549805f;
  x = max(x, set1(-c));
  x = where_nonnegative(x - set1(c), set1(c), x);
  const F16 x2 = x * x;
  F16 p = set1(-2.76076847742355e-16f);
  for (const float a : {2.00018790482477e-13f, -8.60467152213735e-11f, 5.12229709037114e-08f,
                        1.48572235717979e-05f, 6.37261928875436e-04f, 4.89352455891786e-03f})
    p = fma(p, x2, set1(a));
  F16 q = set1(1.19825839466702e-06f);
  for (const float b : {1.18534705686654e-04f, 2.26843463243900e-03f, 4.89352518554385e-03f})
    q = fma(q, x2, set1(b));
  return x * p / q;
}

// The soft-capped scores cap * tanh(s / cap) (inv = 1 / cap)
inline F16 softcap(F16 s, float cap, float inv) {
  return set1(cap) * tanh_rational(s * set1(inv));
}

// softcap on a row s[0, n), n a multiple of 16, in place
inline void softcap_row(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap;
  for (int64_t k = 0; k < n; k += 16) store(s + k, softcap(load(s + k), cap, inv));
}

// The scaled scores of query q (64 floats) against 16 key rows (kb, `row` elements apart, float
// or bf16 bits; rows from nc on repeat row nc - 1: the caller masks them): lane j is token j's
// score.
template <typename T>
inline F16 scores16(const float* q, const T* kb, int64_t row, int nc, float scale) {
  const F16 q0 = load(q), q1 = load(q + 16), q2 = load(q + 32), q3 = load(q + 48);
  Quad f[4];
#pragma GCC unroll 4
  for (int j4 = 0; j4 < 4; ++j4) {
    F16 d[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const T* k = kb + std::min(4 * j4 + i, nc - 1) * row;
      F16 s = q0 * load(k);
      s = fma(q1, load(k + 16), s);
      s = fma(q2, load(k + 32), s);
      d[i] = fma(q3, load(k + 48), s);
    }
    f[j4] = quad(d);
  }
  return combine(f) * set1(scale);
}

// One decode task for head_dim 64, in two passes over its blocks [blk_begin, blk_end): every
// score first (each K row read once, one transpose-and-add per 16 tokens), then one softmax per
// query head over all of them, then the weighted sum of V (each V row read once, the
// probabilities broadcast from memory). Leaves the partial state attend_blocks
// (decode_attention.cpp) does: acc [Hq, 64] unnormalised, max mx [Hq], denominator den [Hq].
// T: float, or uint16_t for bfloat16 bits.
//
// Why two passes: a per-block online softmax runs a max, an exp and two reductions per 16
// tokens per head, a latency chain of a few hundred cycles each time, and rescales the
// accumulators; with 64 sequences x 320 tokens the attention streamed KV well below a plain
// read of the same bytes. One softmax per head per task
// leaves the FMAs. scores: scratch, resized here to Hq x (tokens rounded up to 16).
// lim.head_len (nullable): head h sees only the first head_len[h] <= L tokens. The rows of one
// sequence verifying drafts come as one task this way, each row's heads as heads of their own
// with the row's length: every K/V block is read once for all rows, and a row's result is
// bit-identical to its own task's (the tokens past its length get probability exactly 0).
// lim.start / head_start: a sliding window's first token, at most one block into the task's
// range (the caller starts the range at the window's block): the tokens before it get
// probability exactly 0, as those past a row's length do. lim.softcap > 0: scores soft-capped.
template <typename T>
inline void attend_blocks_d64(const float* qf, const T* kp, const T* vp, const int64_t* table,
                              int64_t L, int64_t blk_begin, int64_t blk_end, int64_t BS,
                              int64_t Hkv, int64_t Hq, int64_t block_stride,
                              const int64_t* heads_by_kv, const int64_t* group_start,
                              float scale, float* acc, float* mx, float* den,
                              std::vector<float>& scores, const attn::KeyLimits& lim) {
  const int64_t row = Hkv * 64, t0 = blk_begin * BS;
  const int64_t T_ = std::max<int64_t>(0, std::min(L, blk_end * BS) - t0);
  const int64_t Tp = (T_ + 15) / 16 * 16;
  std::fill(acc, acc + Hq * 64, 0.f);
  std::fill(mx, mx + Hq, -INFINITY);
  std::fill(den, den + Hq, 0.f);
  if (T_ == 0) return;
  scores.resize(Hq * Tp);
  float* sc = scores.data();
  const int64_t nblk = blk_end - blk_begin;
  // The block kAhead blocks on is prefetched while this one is computed (SpreadPrefetch): in
  // pass 1 a share of its lines before each score tile, in pass 2 before each V row.
  constexpr int64_t kAhead = 2;
  constexpr int GMAX = kRegsPerVec == 1 ? 4 : 1;  // pass 2's heads in registers at a time
  const int64_t block_lines = (BS * row * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const int64_t k_tiles = Hq * ((BS + 15) / 16);  // pass 1's score tiles in a block
  int64_t v_tiles = 0;  // pass 2's head tiles across the KV heads
  for (int64_t kh = 0; kh < Hkv; ++kh)
    v_tiles += (group_start[kh + 1] - group_start[kh] + GMAX - 1) / GMAX;
  const int64_t k_share = (block_lines + k_tiles - 1) / k_tiles;
  const int64_t v_share = (block_lines + v_tiles * BS - 1) / std::max<int64_t>(1, v_tiles * BS);
  const bool touch = g_attention_touch_pass.load(std::memory_order_relaxed);
  const float cap = lim.softcap, inv_cap = cap > 0.f ? 1.f / cap : 0.f;
  SpreadPrefetch pf;
  for (int64_t b = 0; b < std::min(kAhead, nblk); ++b) {
    pf.start(kp + table[blk_begin + b] * block_stride, block_lines);
    pf.finish();
  }
  // pass 1: scores; the K blocks kAhead on, then the first V blocks, are prefetched meanwhile
  for (int64_t b = 0; b < nblk; ++b) {
    pf.finish();
    if (b + kAhead < nblk)
      pf.start(kp + table[blk_begin + b + kAhead] * block_stride, block_lines);
    else if (b + kAhead - nblk < nblk)
      pf.start(vp + table[blk_begin + b + kAhead - nblk] * block_stride, block_lines);
    const int64_t blk = blk_begin + b, base = blk * BS - t0;
    const int64_t n = std::min(BS, L - blk * BS);
    const T* kblk = kp + table[blk] * block_stride;
    if (touch) touch_lines(kblk, n * row);
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      const T* kb = kblk + kh * 64;
      for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int nc = static_cast<int>(std::min<int64_t>(16, n - j0));
        for (int64_t g = group_start[kh]; g < group_start[kh + 1]; ++g) {
          const int64_t h = heads_by_kv[g];
          pf.step(k_share);
          F16 sv = scores16(qf + h * 64, kb + j0 * row, row, nc, scale);
          if (cap > 0.f) sv = softcap(sv, cap, inv_cap);
          store_first(sc + h * Tp + base + j0, sv, nc);
        }
      }
    }
  }
  // one softmax per head over the task's T scores (unnormalised probabilities in place)
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t limit = lim.head_len ? std::clamp<int64_t>(lim.head_len[h] - t0, 0, T_) : T_;
    const int64_t first = (lim.head_start ? lim.head_start[h] : lim.start) - t0;
    const SoftmaxRow r = softmax_row(sc + h * Tp, limit, Tp, first);
    mx[h] = r.max, den[h] = r.sum;
  }
  // pass 2: acc += p * V, up to GMAX = 4 heads of a KV head at a time in registers (AVX2: one,
  // its 8 accumulator registers fill half of the 16; the V rows come again from L1 per head)
  for (int64_t b = 0; b < nblk; ++b) {
    pf.finish();
    if (b + kAhead < nblk) pf.start(vp + table[blk_begin + b + kAhead] * block_stride, block_lines);
    const int64_t blk = blk_begin + b, base = blk * BS - t0;
    const int64_t n = std::min(BS, L - blk * BS);
    const T* vblk = vp + table[blk] * block_stride;
    if (touch) touch_lines(vblk, n * row);
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      const T* vb = vblk + kh * 64;
      for (int64_t g0 = group_start[kh]; g0 < group_start[kh + 1]; g0 += GMAX) {
        const int G = static_cast<int>(std::min<int64_t>(GMAX, group_start[kh + 1] - g0));
        F16 a[GMAX][4];
        const float* p[GMAX];
        for (int g = 0; g < G; ++g) {
          const int64_t h = heads_by_kv[g0 + g];
          p[g] = sc + h * Tp + base;
          for (int c = 0; c < 4; ++c) a[g][c] = load(acc + h * 64 + 16 * c);
        }
        for (int64_t j = 0; j < n; ++j) {
          pf.step(v_share);
          const T* v = vb + j * row;
          const F16 v0 = load(v), v1 = load(v + 16), v2 = load(v + 32), v3 = load(v + 48);
          for (int g = 0; g < G; ++g) {
            const F16 pj = set1(p[g][j]);
            a[g][0] = fma(pj, v0, a[g][0]);
            a[g][1] = fma(pj, v1, a[g][1]);
            a[g][2] = fma(pj, v2, a[g][2]);
            a[g][3] = fma(pj, v3, a[g][3]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < 4; ++c) store(acc + heads_by_kv[g0 + g] * 64 + 16 * c, a[g][c]);
      }
    }
  }
}

}  // namespace simd
#endif
