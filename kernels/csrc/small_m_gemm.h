// The driver shared by the small-batch linears (cpu_gemv.cpp float32, cpu_gemv_bf16.cpp bf16):
// y[M, N] (float32) = x[M, K] . w[N, K]^T in tiles of 4 weight rows x up to 4 input rows, each
// weight row read from memory once, whatever M. Tile::run<R, MM>(w, x, K, y, ldy) computes
// R weight rows (w, stride K) x MM input rows (x, stride K) into y[m * ldy + r].
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace small_m {

template <class Tile, int R, typename E>
inline void rows_by_inputs(const E* w, const E* x, int64_t M, int64_t K, float* y, int64_t ldy) {
  // inputs in groups of 4: the R weight rows come from memory once, then from L1
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) Tile::template run<R, 4>(w, x + m * K, K, y + m * ldy, ldy);
  switch (M - m) {
    case 3: Tile::template run<R, 3>(w, x + m * K, K, y + m * ldy, ldy); break;
    case 2: Tile::template run<R, 2>(w, x + m * K, K, y + m * ldy, ldy); break;
    case 1: Tile::template run<R, 1>(w, x + m * K, K, y + m * ldy, ldy); break;
    default: break;
  }
}

template <class Tile, typename E>
void gemm(const E* w, const E* x, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t blocks = (N + 3) / 4;
  // >= ~64 KB of weights per task: small layers stay on one thread
  const int64_t grain = std::max<int64_t>(
      1, 65536 / std::max<int64_t>(1, 4 * K * static_cast<int64_t>(sizeof(E))));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * 4;
      if (n + 4 <= N) {
        rows_by_inputs<Tile, 4>(w + n * K, x, M, K, y + n, N);
      } else {
        for (int64_t r = n; r < N; ++r) rows_by_inputs<Tile, 1>(w + r * K, x, M, K, y + r, N);
      }
    }
  });
}

}  // namespace small_m
