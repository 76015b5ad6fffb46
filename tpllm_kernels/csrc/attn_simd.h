// The decode attention over the paged cache for any head_dim that is a multiple of 16 (64, 128,
// 256, ...), written once against simd::F16 (vec.h: AVX-512, or AVX2 + FMA as two registers per
// vector), for float32 or bfloat16 caches (bf16 rows widened as they are loaded), and the
// softmax row the prefill attention shares.
//
// Why: the portable block step (decode_attention.cpp, block_group_fast) sums each token's score
// with its own 16-lane horizontal reduction and runs the softmax in scalar code: about twice the
// time its KV bytes take to stream (head_dim 64); at 128 its register tile spilled on AVX2, and
// other sizes ran one query head at a time.
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
// ...and only blocks of at most this many bytes (half of a 32 KB L1d). The Zen 4 measurement
// had 12 KB blocks (9 q / 3 kv heads of 64, float32); a block that does not fit in L1 beside
// the query heads' data (head_dim 128 x 8 KV heads: 64 KB) is pushed out by its own touch before
// the heads read it, and on a Zen 3 the touch slowed blocks of 32 KB and more instead (head_dim
// 64 and 128 with 8 KV heads, timed over one layer's cache and over 28 layers' caches).
constexpr int64_t kTouchMaxBytes = 16 * 1024;

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

// One hardware register (Nat) of bfloat16 bits widened to float: exact, a shift (vec.h's Nat
// loads read float only)
inline Nat nload(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#endif
}

// The scaled scores of query q (16 C floats: C = CT, or c_rt where CT is 0) against 16 key rows
// (kb, `row` elements apart, float or bf16 bits; rows from nc on repeat row nc - 1: the caller
// masks them): lane j is token j's score. Each token's 16-lane partial sums run over the head's
// chunks in order (a product, then FMAs), then 16 tokens' partials are transposed and added at
// once; 4 tokens at a time, each query chunk loaded once for the 4.
template <int CT, typename T>
inline F16 scores16(const float* q, const T* kb, int64_t row, int nc, float scale, int c_rt) {
  const int C = CT > 0 ? CT : c_rt;
  Quad f[4];
#pragma GCC unroll 4
  for (int j4 = 0; j4 < 4; ++j4) {
    const T* k[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) k[i] = kb + std::min(4 * j4 + i, nc - 1) * row;
    F16 d[4];
    const F16 q0 = load(q);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) d[i] = q0 * load(k[i]);
#pragma GCC unroll 4
    for (int c = 1; c < C; ++c) {
      const F16 qc = load(q + 16 * c);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) d[i] = fma(qc, load(k[i] + 16 * c), d[i]);
    }
    f[j4] = quad(d);
  }
  return combine(f) * set1(scale);
}

// Pass 2's register tile: G query heads x NR hardware registers of columns. AVX-512: up to 4
// heads x 64 columns (16 of its 32 registers); AVX2: one head x 64 columns (8 of its 16
// registers; the V rows come again from L1 per head). Held as Nat, not F16: GCC spills arrays
// of AVX2's two-register F16s (prefill_attention.cpp says so too). Every lane's FMAs are the
// same on both ISAs, in token order: the tiling does not change the bits.
constexpr int kPvHeads = kRegsPerVec == 1 ? 4 : 1;
constexpr int kPvCols = 64;

// o[g][0, NR lanes) += sum over tokens j < n of p[g][j] * v[j] (v's rows `row` apart), for
// G heads; the prefetch takes `share` lines before each row
template <int G, int NR, typename T>
inline void pv_tile(const float* const* p, const T* vb, int64_t row, int64_t n,
                    float* const* o, SpreadPrefetch& pf, int64_t share) {
  Nat a[G][NR];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) a[g][c] = nload(o[g] + kNatLanes * c);
  for (int64_t j = 0; j < n; ++j) {
    pf.step(share);
    const T* v = vb + j * row;
    Nat vv[NR];
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) vv[c] = nload(v + kNatLanes * c);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const Nat pj = nset1(p[g][j]);
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) a[g][c] = nfma(pj, vv[c], a[g][c]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) nstore(o[g] + kNatLanes * c, a[g][c]);
}

// pv_tile for a runtime head count g in [1, G]
template <int G, int NR, typename T>
inline void pv_heads(int g, const float* const* p, const T* vb, int64_t row, int64_t n,
                     float* const* o, SpreadPrefetch& pf, int64_t share) {
  if constexpr (G > 1) {
    if (g < G) return pv_heads<G - 1, NR>(g, p, vb, row, n, o, pf, share);
  }
  pv_tile<G, NR>(p, vb, row, n, o, pf, share);
}

// pv_heads for `cols` columns (a multiple of 16, at most kPvCols)
template <typename T>
inline void pv_cols(int cols, int g, const float* const* p, const T* vb, int64_t row, int64_t n,
                    float* const* o, SpreadPrefetch& pf, int64_t share) {
  static_assert(kPvCols == 64, "the cases below");
  constexpr int k = kNatLanes;
  switch (cols) {
    case 64: return pv_heads<kPvHeads, 64 / k>(g, p, vb, row, n, o, pf, share);
    case 48: return pv_heads<kPvHeads, 48 / k>(g, p, vb, row, n, o, pf, share);
    case 32: return pv_heads<kPvHeads, 32 / k>(g, p, vb, row, n, o, pf, share);
    default: return pv_heads<kPvHeads, 16 / k>(g, p, vb, row, n, o, pf, share);
  }
}

// One decode task for a head_dim D that is a multiple of 16 (CT = D / 16 where the caller
// instantiates it for that size, else 0), in two passes over its blocks [blk_begin, blk_end):
// every score first (each K row read once per query head from L1, one transpose-and-add per
// 16 tokens), then one softmax per query head over all of them, then the weighted sum of V
// (pv_tile; the probabilities broadcast from memory). Leaves the partial state attend_blocks
// (decode_attention.cpp) does: acc [Hq, D] unnormalised, max mx [Hq], denominator den [Hq].
// T: float, or uint16_t for bfloat16 bits. Every sum runs in the same order on each ISA and
// for every CT: the same bits from any variant.
//
// Why two passes: a per-block online softmax runs a max, an exp and two reductions per 16
// tokens per head, a latency chain of a few hundred cycles each time, and rescales the
// accumulators; with 64 sequences x 320 tokens the attention streamed KV well below a plain
// read of the same bytes. One softmax per head per task leaves the FMAs. (The portable block
// step it replaced for head_dim 128 also spilled AVX2's registers, and 256 ran a scalar step
// per head.) scores: scratch, resized here to Hq x (tokens rounded up to 16).
// lim.head_len (nullable): head h sees only the first head_len[h] <= L tokens. The rows of one
// sequence verifying drafts come as one task this way, each row's heads as heads of their own
// with the row's length: every K/V block is read once for all rows, and a row's result is
// bit-identical to its own task's (the tokens past its length get probability exactly 0).
// lim.start / head_start: a sliding window's first token, at most one block into the task's
// range (the caller starts the range at the window's block): the tokens before it get
// probability exactly 0, as those past a row's length do. lim.softcap > 0: scores soft-capped.
template <int CT, typename T>
inline void attend_blocks_simd(const float* qf, const T* kp, const T* vp, const int64_t* table,
                               int64_t L, int64_t blk_begin, int64_t blk_end, int64_t BS,
                               int64_t Hkv, int64_t Hq, int64_t D, int64_t block_stride,
                               const int64_t* heads_by_kv, const int64_t* group_start,
                               float scale, float* acc, float* mx, float* den,
                               std::vector<float>& scores, const attn::KeyLimits& lim) {
  const int c_rt = static_cast<int>(D / 16);
  const int64_t row = Hkv * D, t0 = blk_begin * BS;
  const int64_t T_ = std::max<int64_t>(0, std::min(L, blk_end * BS) - t0);
  const int64_t Tp = (T_ + 15) / 16 * 16;
  std::fill(acc, acc + Hq * D, 0.f);
  std::fill(mx, mx + Hq, -INFINITY);
  std::fill(den, den + Hq, 0.f);
  if (T_ == 0) return;
  scores.resize(Hq * Tp);
  float* sc = scores.data();
  const int64_t nblk = blk_end - blk_begin;
  // The block kAhead blocks on is prefetched while this one is computed (SpreadPrefetch): in
  // pass 1 a share of its lines before each score tile, in pass 2 before each V row of a tile.
  constexpr int64_t kAhead = 2;
  const int64_t block_lines = (BS * row * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const int64_t k_tiles = Hq * ((BS + 15) / 16);  // pass 1's score tiles in a block
  const int64_t col_tiles = (D + kPvCols - 1) / kPvCols;
  int64_t v_tiles = 0;  // pass 2's register tiles across the KV heads
  for (int64_t kh = 0; kh < Hkv; ++kh)
    v_tiles += (group_start[kh + 1] - group_start[kh] + kPvHeads - 1) / kPvHeads * col_tiles;
  const int64_t k_share = (block_lines + k_tiles - 1) / k_tiles;
  const int64_t v_share = (block_lines + v_tiles * BS - 1) / std::max<int64_t>(1, v_tiles * BS);
  const bool touch = g_attention_touch_pass.load(std::memory_order_relaxed) &&
                     BS * row * static_cast<int64_t>(sizeof(T)) <= kTouchMaxBytes;
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
      const T* kb = kblk + kh * D;
      for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int nc = static_cast<int>(std::min<int64_t>(16, n - j0));
        for (int64_t g = group_start[kh]; g < group_start[kh + 1]; ++g) {
          const int64_t h = heads_by_kv[g];
          pf.step(k_share);
          F16 sv = scores16<CT>(qf + h * D, kb + j0 * row, row, nc, scale, c_rt);
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
  // pass 2: acc += p * V, a register tile of up to kPvHeads heads of a KV head x kPvCols
  // columns at a time, over the block's rows
  for (int64_t b = 0; b < nblk; ++b) {
    pf.finish();
    if (b + kAhead < nblk) pf.start(vp + table[blk_begin + b + kAhead] * block_stride, block_lines);
    const int64_t blk = blk_begin + b, base = blk * BS - t0;
    const int64_t n = std::min(BS, L - blk * BS);
    const T* vblk = vp + table[blk] * block_stride;
    if (touch) touch_lines(vblk, n * row);
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      const T* vb = vblk + kh * D;
      for (int64_t g0 = group_start[kh]; g0 < group_start[kh + 1]; g0 += kPvHeads) {
        const int G = static_cast<int>(std::min<int64_t>(kPvHeads, group_start[kh + 1] - g0));
        const float* p[kPvHeads];
        float* o[kPvHeads];
        for (int g = 0; g < G; ++g) p[g] = sc + heads_by_kv[g0 + g] * Tp + base;
        for (int64_t c0 = 0; c0 < D; c0 += kPvCols) {
          for (int g = 0; g < G; ++g) o[g] = acc + heads_by_kv[g0 + g] * D + c0;
          const int cols = static_cast<int>(std::min<int64_t>(kPvCols, D - c0));
          pv_cols(cols, G, p, vb + c0, row, n, o, pf, v_share);
        }
      }
    }
  }
}

}  // namespace simd
#endif
