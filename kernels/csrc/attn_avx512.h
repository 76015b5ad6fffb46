// The decode-attention block step for head_dim 64 in AVX-512: up to 4 query heads that read one
// KV head, against one KV block of n tokens (any n: taken 16 at a time), online softmax.
//
// Why: the portable step (cpu_kernels.cpp, block_group_fast) sums each token's score with its
// own 16-lane horizontal reduction and runs the softmax in scalar code; one thread spent ~160 us
// per SmolLM2 layer at 1088 tokens, twice the time its 1.67 MB of KV take to stream. Here the 16
// tokens' partial dot products are transposed and summed together (45 shuffles and adds instead
// of 16 reductions), and max, exp and sum run on whole vectors.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace avx512 {

// d[j] (j < 16) -> one vector whose lane j is the sum of d[j]'s lanes
inline __m512 transpose_sum16(const __m512* d) {
  __m512 e[8], f[4];
  for (int j = 0; j < 8; ++j)  // lanes of 128 bits: [a0+a2, b0+b2, a1+a3, b1+b3]
    e[j] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * j], d[2 * j + 1]),
                         _mm512_unpackhi_ps(d[2 * j], d[2 * j + 1]));
  for (int k = 0; k < 4; ++k)  // each 128-bit lane: tokens 4k..4k+3, partial over that lane
    f[k] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * k], e[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(e[2 * k], e[2 * k + 1], 0xEE));
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], 0x44),
                                   _mm512_shuffle_f32x4(f[0], f[1], 0xEE));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(f[2], f[3], 0x44),
                                   _mm512_shuffle_f32x4(f[2], f[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
}

// exp(x) for x <= 0: 2^k * p(r), x = k ln2 + r, p the degree-6 Taylor polynomial of the scalar
// exp_nonpositive (cpu_kernels.cpp)
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, k);
}

struct SoftmaxRow {
  float max, sum;
};

// Scores s[0, limit) -> exp(s - max) in place, zeros on [limit, n) (n a multiple of 16): the
// unnormalised probabilities of one row, with its max and sum (decode keeps both to merge
// splits; prefill divides by the sum).
inline SoftmaxRow softmax_row(float* s, int64_t limit, int64_t n) {
  auto mask = [limit](int64_t k) -> __mmask16 {
    const int64_t left = limit - k;
    return left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1u);
  };
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t k = 0; k < n; k += 16) m = _mm512_mask_max_ps(m, mask(k), m, _mm512_loadu_ps(s + k));
  const float mx = _mm512_reduce_max_ps(m);
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 16) {
    const __m512 p =
        _mm512_maskz_mov_ps(mask(k), exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + k), mv)));
    _mm512_storeu_ps(s + k, p);
    sum = _mm512_add_ps(sum, p);
  }
  return {mx, _mm512_reduce_add_ps(sum)};
}

// The scaled scores of query q (64 floats) against 16 key rows (kb, `row` floats apart; rows
// from nc on repeat row nc - 1: the caller masks them): lane j is token j's score.
inline __m512 scores16(const float* q, const float* kb, int64_t row, int nc, float scale) {
  const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16),
               q2 = _mm512_loadu_ps(q + 32), q3 = _mm512_loadu_ps(q + 48);
  __m512 d[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const float* k = kb + std::min(j, nc - 1) * row;
    __m512 s = _mm512_mul_ps(q0, _mm512_loadu_ps(k));
    s = _mm512_fmadd_ps(q1, _mm512_loadu_ps(k + 16), s);
    s = _mm512_fmadd_ps(q2, _mm512_loadu_ps(k + 32), s);
    d[j] = _mm512_fmadd_ps(q3, _mm512_loadu_ps(k + 48), s);
  }
  return _mm512_mul_ps(transpose_sum16(d), _mm512_set1_ps(scale));
}

// heads[0, G) (G <= 4) all read KV head kh; rows of the block are `row` floats apart.
// acc [Hq, 64] (unnormalised), mx / den [Hq]: the heads' running softmax states.
inline void block_group_d64(const float* qf, const float* kblk, const float* vblk, int64_t n,
                            int64_t row, int64_t kh, const int64_t* heads, int64_t G,
                            float scale, float* acc, float* mx, float* den) {
  constexpr int GMAX = 4;  // registers: p[4] + a[4][4] + the V row's 4 stay below 32
  const float* kb = kblk + kh * 64;
  const float* vb = vblk + kh * 64;
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int nc = static_cast<int>(std::min<int64_t>(16, n - j0));
    const __mmask16 valid = static_cast<__mmask16>((1u << nc) - 1u);
    __m512 p[GMAX], a[GMAX][4];
    for (int g = 0; g < G; ++g) {
      const __m512 s = scores16(qf + heads[g] * 64, kb + j0 * row, row, nc, scale);  // masked below
      const int64_t h = heads[g];
      const float m = std::max(mx[h], _mm512_mask_reduce_max_ps(valid, s));
      const float corr = std::exp(mx[h] - m);  // 0 on the first block: acc is still 0
      mx[h] = m;
      p[g] = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(m))));
      den[h] = den[h] * corr + _mm512_reduce_add_ps(p[g]);
      const __m512 cv = _mm512_set1_ps(corr);
      for (int c = 0; c < 4; ++c) a[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * 64 + 16 * c), cv);
    }
    for (int j = 0; j < nc; ++j) {
      const float* v = vb + (j0 + j) * row;
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16),
                   v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);
      const __m512i lane = _mm512_set1_epi32(j);
      for (int g = 0; g < G; ++g) {
        const __m512 pj = _mm512_permutexvar_ps(lane, p[g]);
        a[g][0] = _mm512_fmadd_ps(pj, v0, a[g][0]);
        a[g][1] = _mm512_fmadd_ps(pj, v1, a[g][1]);
        a[g][2] = _mm512_fmadd_ps(pj, v2, a[g][2]);
        a[g][3] = _mm512_fmadd_ps(pj, v3, a[g][3]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + heads[g] * 64 + 16 * c, a[g][c]);
  }
}

// One decode task for head_dim 64 and float32 caches, in two passes over its blocks
// [blk_begin, blk_end): every score first (each K row read once, one transpose-and-add per 16
// tokens), then one softmax per query head over all of them, then the weighted sum of V (each
// V row read once, the probabilities broadcast from memory). Leaves the same partial state as
// attend_blocks: acc [Hq, 64] unnormalised, max mx [Hq], denominator den [Hq].
//
// Why: the per-block online softmax (block_group_d64) runs a max, an exp and two reductions per
// 16 tokens per head, a latency chain of a few hundred cycles each time, and rescales the
// accumulators; with 64 sequences x 320 tokens the attention streamed KV at 19.5 GB/s where a
// plain read of the same bytes reaches 26.7. One softmax per head per task leaves the FMAs.
// scores: scratch, resized here to Hq x (tokens rounded up to 16).
inline void attend_blocks_d64(const float* qf, const float* kp, const float* vp,
                              const int64_t* table, int64_t L, int64_t blk_begin, int64_t blk_end,
                              int64_t BS, int64_t Hkv, int64_t Hq, int64_t block_stride,
                              const int64_t* heads_by_kv, const int64_t* group_start,
                              float scale, float* acc, float* mx, float* den,
                              std::vector<float>& scores) {
  const int64_t row = Hkv * 64, t0 = blk_begin * BS;
  const int64_t T = std::max<int64_t>(0, std::min(L, blk_end * BS) - t0);
  const int64_t Tp = (T + 15) / 16 * 16;
  std::fill(acc, acc + Hq * 64, 0.f);
  std::fill(mx, mx + Hq, -INFINITY);
  std::fill(den, den + Hq, 0.f);
  if (T == 0) return;
  scores.resize(Hq * Tp);
  float* sc = scores.data();
  const int64_t nblk = blk_end - blk_begin;
  auto prefetch = [&](const float* base, int64_t blk) {
    const float* p = base + table[blk] * block_stride;
    for (int64_t i = 0; i < BS * row; i += 16) __builtin_prefetch(p + i);
  };
  // pass 1: scores; the K blocks two ahead, then the first V blocks, are prefetched meanwhile
  for (int64_t b = 0; b < nblk; ++b) {
    if (b + 2 < nblk) prefetch(kp, blk_begin + b + 2);
    else if (b + 2 - nblk < nblk) prefetch(vp, blk_begin + b + 2 - nblk);
    const int64_t blk = blk_begin + b, base = blk * BS - t0;
    const int64_t n = std::min(BS, L - blk * BS);
    const float* kblk = kp + table[blk] * block_stride;
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      const float* kb = kblk + kh * 64;
      for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int nc = static_cast<int>(std::min<int64_t>(16, n - j0));
        const __mmask16 valid = static_cast<__mmask16>((1u << nc) - 1u);
        for (int64_t g = group_start[kh]; g < group_start[kh + 1]; ++g) {
          const int64_t h = heads_by_kv[g];
          _mm512_mask_storeu_ps(sc + h * Tp + base + j0, valid,
                                scores16(qf + h * 64, kb + j0 * row, row, nc, scale));
        }
      }
    }
  }
  // one softmax per head over the task's T scores (unnormalised probabilities in place)
  for (int64_t h = 0; h < Hq; ++h) {
    const SoftmaxRow r = softmax_row(sc + h * Tp, T, Tp);
    mx[h] = r.max, den[h] = r.sum;
  }
  // pass 2: acc += p * V, up to 4 heads of a KV head at a time in registers
  for (int64_t b = 0; b < nblk; ++b) {
    if (b + 2 < nblk) prefetch(vp, blk_begin + b + 2);
    const int64_t blk = blk_begin + b, base = blk * BS - t0;
    const int64_t n = std::min(BS, L - blk * BS);
    const float* vblk = vp + table[blk] * block_stride;
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      const float* vb = vblk + kh * 64;
      for (int64_t g0 = group_start[kh]; g0 < group_start[kh + 1]; g0 += 4) {
        const int G = static_cast<int>(std::min<int64_t>(4, group_start[kh + 1] - g0));
        __m512 a[4][4];
        const float* p[4];
        for (int g = 0; g < G; ++g) {
          const int64_t h = heads_by_kv[g0 + g];
          p[g] = sc + h * Tp + base;
          for (int c = 0; c < 4; ++c) a[g][c] = _mm512_loadu_ps(acc + h * 64 + 16 * c);
        }
        for (int64_t j = 0; j < n; ++j) {
          const float* v = vb + j * row;
          const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16),
                       v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);
          for (int g = 0; g < G; ++g) {
            const __m512 pj = _mm512_set1_ps(p[g][j]);
            a[g][0] = _mm512_fmadd_ps(pj, v0, a[g][0]);
            a[g][1] = _mm512_fmadd_ps(pj, v1, a[g][1]);
            a[g][2] = _mm512_fmadd_ps(pj, v2, a[g][2]);
            a[g][3] = _mm512_fmadd_ps(pj, v3, a[g][3]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < 4; ++c)
            _mm512_storeu_ps(acc + heads_by_kv[g0 + g] * 64 + 16 * c, a[g][c]);
      }
    }
  }
}

}  // namespace avx512
#endif
