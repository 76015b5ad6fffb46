// The AVX512-BF16 tile of small_m::gemm (small_m_gemm.h): pairs of bf16 products summed into
// float32 lanes (vdpbf16ps), 4 inputs a pass; the bf16 GEMV (cpu_gemv_bf16.cpp) and the exact
// logits of a bf16 head's screen (q8_head_screen.cpp) sum a row the same way with it.
#pragma once
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>

#include "small_m_gemm.h"

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
#endif
