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
#include "vec.h"

#if defined(TPLLM_SIMD16)
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
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

// Scores s[0, limit) -> exp(s - max) in place, zeros on [limit, n) (n a multiple of 16): the
// unnormalised probabilities of one row, with its max and sum (decode keeps both to merge
// splits; prefill divides by the sum).
inline SoftmaxRow softmax_row(float* s, int64_t limit, int64_t n) {
  auto left = [limit](int64_t k) { return static_cast<int>(std::clamp<int64_t>(limit - k, 0, 16)); };
  F16 m = set1(-INFINITY);
  for (int64_t k = 0; k < n; k += 16) m = max(m, first(load(s + k), left(k), -INFINITY));
  const float mx = reduce_max(m);
  const F16 mv = set1(mx);
  F16 sum = set1(0.f);
  for (int64_t k = 0; k < n; k += 16) {
    const F16 p = first(exp_nonpositive(load(s + k) - mv), left(k), 0.f);
    store(s + k, p);
    sum = sum + p;
  }
  return {mx, reduce_add(sum)};
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
// head_len (nullable): head h sees only the first head_len[h] <= L tokens. The rows of one
// sequence verifying drafts come as one task this way, each row's heads as heads of their own
// with the row's length: every K/V block is read once for all rows, and a row's result is
// bit-identical to its own task's (the tokens past its length get probability exactly 0).
template <typename T>
inline void attend_blocks_d64(const float* qf, const T* kp, const T* vp, const int64_t* table,
                              int64_t L, int64_t blk_begin, int64_t blk_end, int64_t BS,
                              int64_t Hkv, int64_t Hq, int64_t block_stride,
                              const int64_t* heads_by_kv, const int64_t* group_start,
                              float scale, float* acc, float* mx, float* den,
                              std::vector<float>& scores, const int64_t* head_len = nullptr) {
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
          store_first(sc + h * Tp + base + j0, scores16(qf + h * 64, kb + j0 * row, row, nc, scale),
                      nc);
        }
      }
    }
  }
  // one softmax per head over the task's T scores (unnormalised probabilities in place)
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t limit = head_len ? std::clamp<int64_t>(head_len[h] - t0, 0, T_) : T_;
    const SoftmaxRow r = softmax_row(sc + h * Tp, limit, Tp);
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
