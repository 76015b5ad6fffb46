// The driver shared by the small-batch linears (cpu_gemv.cpp float32, cpu_gemv_bf16.cpp bf16):
// y[M, N] (float32) = x[M, K] . w[N, K]^T, a weight row (few inputs) or 4 (more) at a
// time x up to Tile::inputs<R>() input rows, each weight row read from memory once, whatever
// M. Tile::run<R, MM>(w, x, K, y, ldy) computes R weight rows (w, stride K) x MM input rows
// (x, stride K) into y[m * ldy + r]; MM is at most Tile::inputs<R>().
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "thread_team.h"
#include "vec.h"

namespace small_m {

// inputs in groups of Tile::inputs<R>() (AVX-512: 4; AVX2, 16 registers: fewer for 4-row
// tiles): the R weight rows come from memory once, then from L1
template <class Tile, int R, typename W, typename X>
inline void rows_by_inputs(const W* w, const X* x, int64_t M, int64_t K, float* y, int64_t ldy) {
  constexpr int G = Tile::template inputs<R>();
  int64_t m = 0;
  for (; m + G <= M; m += G) Tile::template run<R, G>(w, x + m * K, K, y + m * ldy, ldy);
  const int64_t left = M - m;
  if constexpr (G > 3) if (left == 3) Tile::template run<R, 3>(w, x + m * K, K, y + m * ldy, ldy);
  if constexpr (G > 2) if (left == 2) Tile::template run<R, 2>(w, x + m * K, K, y + m * ldy, ldy);
  if constexpr (G > 1) if (left == 1) Tile::template run<R, 1>(w, x + m * K, K, y + m * ldy, ldy);
}

inline float widen(float x) { return x; }
inline float widen(uint16_t b) {  // bfloat16 bits
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The tile of cpu_gemv.cpp (float32 weights) and of cpu_gemv_bf16.cpp without AVX512-BF16 (bf16
// weights widened as they are loaded): 16-lane fused multiply-adds into float32 accumulators,
// one per weight row and input row (x: float32), each summed as sum16 then the K % 16 tail, so
// y[m, n] is the same whatever M, the thread split and the ISA variant.
struct FmaTile {
#if defined(TPLLM_SIMD16)
  // Input rows a tile of R weight rows takes at once. AVX-512: 4 (4 x 4 accumulators: 16 of
  // its 32 registers). AVX2 (an F16 is two of its 16 ymm): 4-row tiles take 1 input (8
  // registers of accumulators); a single weight row takes 4 (8 accumulators + the weight's
  // 2; each input vector is used once a chunk, so it needs no register of its own).
  template <int R>
  static constexpr int inputs() { return simd::kRegsPerVec == 1 || R == 1 ? 4 : 1; }
  template <int R, int MM, typename W>
  static void run(const W* w, const float* x, int64_t K, float* y, int64_t ldy) {
    using namespace simd;
    F16 acc[R][MM];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MM; ++m) acc[r][m] = set1(0.f);
    const int64_t kv = K - K % 16;
    for (int64_t k = 0; k < kv; k += 16) {
      if constexpr (R == 1) {  // each input vector used once: loaded into the FMA, no register
        const F16 wv = load(w + k);
        for (int m = 0; m < MM; ++m) acc[0][m] = fma(wv, load(x + m * K + k), acc[0][m]);
      } else {
        F16 xs[MM];
        for (int m = 0; m < MM; ++m) xs[m] = load(x + m * K + k);
        for (int r = 0; r < R; ++r) {
          const F16 wv = load(w + r * K + k);
          for (int m = 0; m < MM; ++m) acc[r][m] = fma(wv, xs[m], acc[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MM; ++m) {
        float s = reduce_add(acc[r][m]);
        for (int64_t k = kv; k < K; ++k) s += widen(w[r * K + k]) * x[m * K + k];
        y[m * ldy + r] = s;
      }
  }
#else  // portable: float32 weights only, multiply then add (the module has no FMA contraction)
  template <int R>
  static constexpr int inputs() { return 4; }
  template <int R, int MM>
  static void run(const float* w, const float* x, int64_t K, float* y, int64_t ldy) {
    v16f acc[R][MM];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MM; ++m) acc[r][m] = v16f{};
    const int64_t kv = K - K % 16;
    for (int64_t k = 0; k < kv; k += 16) {
      v16f xs[MM];
      for (int m = 0; m < MM; ++m) xs[m] = load16(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        const v16f wv = load16(w + r * K + k);
        for (int m = 0; m < MM; ++m) acc[r][m] = wv * xs[m] + acc[r][m];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MM; ++m) {
        float s = sum16(acc[r][m]);
        for (int64_t k = kv; k < K; ++k) s += w[r * K + k] * x[m * K + k];
        y[m * ldy + r] = s;
      }
  }
#endif
};

// Software prefetch of the weight rows ahead of the ones being multiplied, into L2, for 3 and
// more input rows. A weight row of one or two inputs takes few instructions, the out-of-order
// window runs far enough ahead for the hardware prefetchers, and prefetching cost up to 5% there.
// With more inputs a row takes proportionally more instructions, the window covers less of the
// stream, and the loads wait on DRAM: the multiply and the memory reads no longer overlap.
// With the prefetch, 3 to 6 inputs cost little more than one (docs/decisions.md, "L2 prefetch
// 4.5 KB ahead"). Two and three float32 rows of K = 576 ahead measured alike; a span's own
// size ahead was no better.
constexpr int64_t kPrefetchAhead = 4608;  // bytes
constexpr int64_t kPrefetchMinInputs = 3;

inline void prefetch_l2(const void* from, int64_t bytes) {
  const char* p = static_cast<const char*>(from);
#if defined(__x86_64__) || defined(__i386__)
  // inline assembly: GCC 12 deleted _mm_prefetch / __builtin_prefetch here as dead code (the
  // built module had no prefetch instruction at all); asm volatile it keeps
  for (int64_t i = 0; i < bytes; i += 64) asm volatile("prefetcht1 %0" : : "m"(*(p + i)));
#else
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 2);
#endif
}

template <class Tile, typename W, typename X>
void gemm(const W* w, const X* x, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(W));
  const bool ahead = M >= kPrefetchMinInputs;
  const char* w_end = reinterpret_cast<const char*>(w + N * K);
  // rows [n, n + rows) are next: fetch the same span kPrefetchAhead bytes further on (within w)
  auto prefetch = [&](int64_t n, int64_t rows) {
    if (!ahead) return;
    const char* p = reinterpret_cast<const char*>(w + n * K) + kPrefetchAhead;
    if (p < w_end) prefetch_l2(p, std::min<int64_t>(rows * row_bytes, w_end - p));
  };
  // >= ~64 KB of weights per task: small layers stay on one thread
  const int64_t grain_rows = std::max<int64_t>(
      1, 65536 / std::max<int64_t>(1, K * static_cast<int64_t>(sizeof(W))));
  // Up to 8 inputs: one weight row at a time, in memory order, so the
  // weights stream as one sequential read per thread chunk (a second group of inputs reads the
  // row again from L1). 4-row tiles read 4 interleaved streams, which the hardware prefetchers
  // followed worse: row by row streamed faster at one input, and with the prefetch above 7 and
  // 8 inputs stay close to 6, where tiles fall behind (docs/decisions.md, "Up to 8 input rows").
  // More inputs: 4-row tiles, where each input vector loaded serves 4 rows. Each y[m, n] is
  // summed the same way in both (its own accumulator, k in order): M changes no row's result.
  constexpr int64_t kRowByRowInputs = 8;
  if (M <= kRowByRowInputs) {
    team::parallel_for(0, N, grain_rows, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        prefetch(n, 1);
        rows_by_inputs<Tile, 1>(w + n * K, x, M, K, y + n, N);
      }
    });
    return;
  }
  // The outputs of 16 consecutive weight rows (4 tiles) go to a stage first, then to y one
  // whole cache line per input row. Written straight to y, each tile put 4 floats in each of
  // M rows N floats apart: when N * 4 bytes is a multiple of 4 KB (lm_head 49152, gate_up 3072)
  // those M lines all fall in one L1 (and L2) set, and with M above its 8 ways every tile
  // missed on each of them again (docs/decisions.md, "From 9 input rows the GEMV stages
  // outputs"). Weights are
  // still read 4 rows at a time in memory order, and each y[m, n] is the same sum.
  constexpr int64_t kStageRows = 16, kStageInputs = 64;
  const int64_t groups = (N + kStageRows - 1) / kStageRows;
  team::parallel_for(0, groups, std::max<int64_t>(1, grain_rows / kStageRows),
                     [&](int64_t g0, int64_t g1) {
    alignas(64) float stage[kStageInputs * kStageRows];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kStageRows, rows = std::min(kStageRows, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kStageInputs) {
        const int64_t mm = std::min(kStageInputs, M - m0);
        const X* xm = x + m0 * K;
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) {
          if (m0 == 0) prefetch(n0 + r, 4);
          rows_by_inputs<Tile, 4>(w + (n0 + r) * K, xm, mm, K, stage + r, kStageRows);
        }
        for (; r < rows; ++r)
          rows_by_inputs<Tile, 1>(w + (n0 + r) * K, xm, mm, K, stage + r, kStageRows);
        for (int64_t m = 0; m < mm; ++m)
          std::memcpy(y + (m0 + m) * N + n0, stage + m * kStageRows, rows * sizeof(float));
      }
    }
  });
}

}  // namespace small_m
