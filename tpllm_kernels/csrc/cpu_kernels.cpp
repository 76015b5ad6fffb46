// Fused CPU kernels for the decode-heavy path, where torch's per-op dispatch and the paged-KV
// gather (copy, then attend) cost more than the arithmetic. Storage float32 or bfloat16 (the
// AMX path); arithmetic always float32. Every function has a torch reference in
// tpllm_kernels/reference.py that the tests compare against.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <algorithm>
#include <vector>

#include "cpu_kernels.h"
#include "vec.h"
#include "attn_simd.h"
#include "thread_team.h"

namespace {

using bf16 = c10::BFloat16;

// float <-> storage conversions as plain bit operations, so `omp simd` loops vectorize: with
// c10's BFloat16 conversions a bf16 silu_mul of 1024 x 1536 took 6.5 ms (torch: 0.6 ms). Same
// rounding as c10 (to nearest even; NaN -> 0x7FC0).
inline float to_f(float x) { return x; }
inline float to_f(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename T>
inline T from_f(float f);
template <>
inline float from_f<float>(float f) { return f; }
template <>
inline bf16 from_f<bf16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return bf16(static_cast<uint16_t>(f != f ? 0x7FC0u : rounded), bf16::from_bits());
}

// Sums below run in 16 lanes added as a fixed tree (vec.h's sum16), not as `omp simd`
// reductions, whose order follows the build's vector width: every ISA variant of the module
// then computes the same bits.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  v16f acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16f bv;
    for (int l = 0; l < 16; ++l) bv[l] = to_f(b[i + l]);
    acc += load16(a + i) * bv;
  }
  float s = sum16(acc);
  for (; i < n; ++i) s += a[i] * to_f(b[i]);
  return s;
}

// the sum of x[0, n) squared, in dot's order
inline float sum_squares(const float* x, int64_t n) {
  v16f acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16f v = load16(x + i);
    acc += v * v;
  }
  float s = sum16(acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

template <typename T>
inline void axpy(float* y, const T* x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * to_f(x[i]);
}

// exp(x) for x <= 0 (softmax arguments), vectorizable: 2^k * p(r) with x = k ln2 + r, |r| <=
// ln2/2, p a degree-6 Taylor polynomial (relative error < 2e-7); underflows to 0 below -87.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float k = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// exp(x) for any x, vectorizable (same polynomial); saturates to inf above 88.7.
inline float exp_any(float x) {
  return x <= 0.f ? exp_nonpositive(x) : 1.f / exp_nonpositive(-x);
}

void check_storage(const torch::Tensor& t, const char* fn) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, fn,
              ": float32 or bfloat16 only");
}

// Work per decode task: whole KV blocks of one sequence. By default every context is cut into
// splits of a fixed number of tokens (flash-decoding: short batches of long contexts still give
// every thread work; the partial softmax states are merged in split order). Fixed, not chosen
// from the batch: a row's result must not depend on what else is in its batch (speculative
// decoding verifies drafts as extra rows and relies on greedy tokens staying identical; a
// sequence's output should not change with the server's load either).
constexpr int64_t kTokensPerSplit = 256;
// The most rows of one sequence attending as one task (decode_attention_impl's runs): CPU
// verify steps carry at most 8 rows.
constexpr int64_t kMaxRunRows = 8;

// Online-softmax update of one query head for a block whose raw scores are in s[0, n): turns them
// into probabilities (in place) and returns the factor the head's accumulator must be scaled by.
inline float softmax_update(float* s, int64_t n, float& mx, float& den) {
  float m = mx;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
  const float corr = std::exp(mx - m);  // 0 on the first block (acc is still 0)
  mx = m;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] = exp_nonpositive(s[j] - m);
  v16f acc = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) acc += load16(s + j);
  float sum = sum16(acc);
  for (; j < n; ++j) sum += s[j];
  den = den * corr + sum;
  return corr;
}

// Query heads heads[0, G) (all reading KV head kh) against one block of n tokens, head_dim D a
// multiple of 16: each K/V row is loaded once for the whole group and the group's accumulators
// stay in vector registers across the block.
template <int D, int GMAX>
void block_group_fast(const float* qf, const float* kblk, const float* vblk, int64_t n,
                      int64_t row, int64_t kh, const int64_t* heads, int64_t G, float scale,
                      float* acc, float* mx, float* den, float* sc, int64_t BS) {
  constexpr int C = D / 16;
  for (int64_t j = 0; j < n; ++j) {
    v16f k[C];
    for (int c = 0; c < C; ++c) k[c] = load16(kblk + j * row + kh * D + 16 * c);
    for (int g = 0; g < GMAX; ++g) {
      if (g >= G) break;
      const float* q = qf + heads[g] * D;
      v16f d = load16(q) * k[0];
      for (int c = 1; c < C; ++c) d += load16(q + 16 * c) * k[c];
      sc[heads[g] * BS + j] = sum16(d) * scale;
    }
  }
  v16f a[GMAX][C];
  for (int g = 0; g < GMAX; ++g) {
    if (g >= G) break;
    const int64_t h = heads[g];
    const float corr = softmax_update(sc + h * BS, n, mx[h], den[h]);
    for (int c = 0; c < C; ++c) a[g][c] = load16(acc + h * D + 16 * c) * corr;
  }
  for (int64_t j = 0; j < n; ++j) {
    v16f v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(vblk + j * row + kh * D + 16 * c);
    for (int g = 0; g < GMAX; ++g) {
      if (g >= G) break;
      const float p = sc[heads[g] * BS + j];
      for (int c = 0; c < C; ++c) a[g][c] += p * v[c];
    }
  }
  for (int g = 0; g < GMAX; ++g) {
    if (g >= G) break;
    for (int c = 0; c < C; ++c) store16(acc + heads[g] * D + 16 * c, a[g][c]);
  }
}

// Any head_dim: one query head at a time, row by row.
inline void block_group_generic(const float* qf, const float* kblk, const float* vblk, int64_t n,
                                int64_t row, int64_t D, int64_t kh, const int64_t* heads,
                                int64_t G, float scale, float* acc, float* mx, float* den,
                                float* sc, int64_t BS) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = heads[g];
    float* s = sc + h * BS;
    for (int64_t j = 0; j < n; ++j) s[j] = dot(qf + h * D, kblk + j * row + kh * D, D) * scale;
    const float corr = softmax_update(s, n, mx[h], den[h]);
    float* a = acc + h * D;
    if (corr != 1.f) {
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) a[i] *= corr;
    }
    for (int64_t j = 0; j < n; ++j) axpy(a, vblk + j * row + kh * D, s[j], D);
  }
}

// One task: the query heads of one sequence against its KV blocks [blk_begin, blk_end), online
// softmax block by block. Leaves unnormalised acc [Hq, D], running max mx [Hq] and denominator
// den [Hq]. A block is [BS, Hkv, D] contiguous and is read once, in order; the block two ahead
// (blocks are scattered: the hardware prefetcher stops at them) is prefetched meanwhile.
// heads_by_kv lists the query heads grouped by the KV head they read, group kh at
// [group_start[kh], group_start[kh + 1]).
template <typename T>
void attend_blocks(const float* qf, const T* kp, const T* vp, const int64_t* table, int64_t L,
                   int64_t blk_begin, int64_t blk_end, int64_t BS, int64_t Hkv, int64_t Hq,
                   int64_t D, int64_t block_stride, const int64_t* heads_by_kv,
                   const int64_t* group_start, float scale, float* acc, float* mx, float* den,
                   std::vector<float>& sc, std::vector<float>& kb, std::vector<float>& vb,
                   const int64_t* head_len = nullptr) {
#if defined(TPLLM_SIMD16)
  if (D == 64) {  // float32, or bf16 rows widened as they are loaded
    using S = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;
    simd::attend_blocks_d64(qf, reinterpret_cast<const S*>(kp), reinterpret_cast<const S*>(vp),
                            table, L, blk_begin, blk_end, BS, Hkv, Hq, block_stride, heads_by_kv,
                            group_start, scale, acc, mx, den, sc, head_len);
    return;
  }
#endif
  TORCH_CHECK(head_len == nullptr, "attend_blocks: per-head lengths need the head_dim 64 path");
  const int64_t row = Hkv * D;
  std::fill(acc, acc + Hq * D, 0.f);
  std::fill(mx, mx + Hq, -INFINITY);
  std::fill(den, den + Hq, 0.f);
  sc.resize(Hq * BS);
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t blk_i = blk_begin; blk_i < blk_end; ++blk_i) {
    const int64_t n = std::min(BS, L - blk_i * BS);
    const T* kbase = kp + table[blk_i] * block_stride;
    const T* vbase = vp + table[blk_i] * block_stride;
    if (blk_i + 2 < blk_end) {
      const T* knext = kp + table[blk_i + 2] * block_stride;
      const T* vnext = vp + table[blk_i + 2] * block_stride;
      for (int64_t i = 0; i < BS * row; i += kLine) {
        __builtin_prefetch(knext + i);
        __builtin_prefetch(vnext + i);
      }
    }
    const float* kblk;
    const float* vblk;
    if constexpr (std::is_same_v<T, float>) {
      kblk = kbase, vblk = vbase;
    } else {  // bf16 storage: widen the block once; every query head then reads fp32
      kb.resize(BS * row), vb.resize(BS * row);
#pragma omp simd
      for (int64_t i = 0; i < n * row; ++i) kb[i] = to_f(kbase[i]);
#pragma omp simd
      for (int64_t i = 0; i < n * row; ++i) vb[i] = to_f(vbase[i]);
      kblk = kb.data(), vblk = vb.data();
    }
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      for (int64_t g = group_start[kh]; g < group_start[kh + 1];) {
        const int64_t* heads = heads_by_kv + g;
        const int64_t left = group_start[kh + 1] - g;
        int64_t G;
        if (D == 64) {
          G = std::min<int64_t>(left, 4);
          block_group_fast<64, 4>(qf, kblk, vblk, n, row, kh, heads, G, scale, acc, mx, den,
                                  sc.data(), BS);
        } else if (D == 128) {
          G = std::min<int64_t>(left, 2);
          block_group_fast<128, 2>(qf, kblk, vblk, n, row, kh, heads, G, scale, acc, mx, den,
                                   sc.data(), BS);
        } else {
          G = left;
          block_group_generic(qf, kblk, vblk, n, row, D, kh, heads, G, scale, acc, mx, den,
                              sc.data(), BS);
        }
        g += G;
      }
    }
  }
}

template <typename T>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& tables,
                           const torch::Tensor& lens, double scale, const torch::Tensor& kvi,
                           int64_t num_splits, torch::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), q_rows = q.stride(0);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t MB = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* ip = kvi.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t block_stride = k_cache.stride(0);
  int64_t max_blocks = 0;
  for (int64_t b = 0; b < B; ++b) max_blocks = std::max(max_blocks, (lp[b] + BS - 1) / BS);
  // explicit num_splits: each context in that many even parts (tests); else fixed-size parts
  const int64_t fixed = std::max<int64_t>(1, kTokensPerSplit / BS);
  const int64_t S = num_splits > 0 ? num_splits : std::max<int64_t>(1, (max_blocks + fixed - 1) / fixed);
  std::vector<int64_t> heads_by_kv, group_start;
  group_heads_by_kv(ip, Hq, Hkv, heads_by_kv, group_start);
  // Runs: consecutive rows of one sequence (a decode verifying drafts: 1 + drafts rows, the same
  // block table, lengths one apart) attend in one task per split, each row's heads as heads of
  // their own (attend_blocks_d64's head_len), so a KV block is read once for all of them, not
  // once per row. SmolLM2's 30 layers (9/3 heads), 2 threads, AMD EPYC Zen 4, interleaved runs:
  // 2048-token context, 5 rows 14.1-14.6 ms vs 19.3-28.9 as a task per row, 8 rows 17.8-18.2 vs
  // 24.0-46.1; 1024: 5 rows 7.4-7.8 vs 9.2-21.2; at ~500 tokens (a layer's K/V fits L2) no
  // change. Only with fixed splits (a row's splits then do not depend on its run) and the
  // head_dim 64 kernel; a row's result is the same bits as alone.
  bool runs_ok = num_splits <= 0 && D == 64;
#if !defined(TPLLM_SIMD16)
  runs_ok = false;
#endif
  std::vector<int64_t> run_start{0};
  for (int64_t b = 1; b < B; ++b) {
    const int64_t r0 = run_start.back();
    const bool joins = runs_ok && b - r0 < kMaxRunRows && lp[b] == lp[b - 1] + 1 &&
                       std::equal(tp + b * MB, tp + b * MB + (lp[b] + BS - 1) / BS, tp + r0 * MB);
    if (!joins) run_start.push_back(b);
  }
  run_start.push_back(B);
  const int64_t num_runs = static_cast<int64_t>(run_start.size()) - 1;
  // the heads of R rows of a run, grouped by KV head: row r's head h is head r * Hq + h
  std::vector<std::vector<int64_t>> run_heads(kMaxRunRows + 1), run_groups(kMaxRunRows + 1);
  for (int64_t i = 0; i < num_runs; ++i) {
    const int64_t R = run_start[i + 1] - run_start[i];
    if (R == 1 || !run_heads[R].empty()) continue;
    run_groups[R].assign(Hkv + 1, 0);
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      run_groups[R][kh] = static_cast<int64_t>(run_heads[R].size());
      for (int64_t r = 0; r < R; ++r)
        for (int64_t g = group_start[kh]; g < group_start[kh + 1]; ++g)
          run_heads[R].push_back(r * Hq + heads_by_kv[g]);
    }
    run_groups[R][Hkv] = static_cast<int64_t>(run_heads[R].size());
  }
  // partial states of every (sequence, split): acc [Hq, D], then max [Hq], then den [Hq]
  const int64_t part = Hq * (D + 2);
  std::vector<float> parts(B * S * part);
  team::parallel_for(0, num_runs * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, sc, kb, vb, state;
    std::vector<int64_t> head_len;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t run = task / S, s = task % S, b0 = run_start[run];
      const int64_t R = run_start[run + 1] - b0, L = lp[b0 + R - 1];
      const int64_t nblk = (L + BS - 1) / BS, per = num_splits > 0 ? (nblk + S - 1) / S : fixed;
      qf.resize(R * Hq * D);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < Hq * D; ++i) qf[r * Hq * D + i] = to_f(qp[(b0 + r) * q_rows + i]);
      const int64_t lo = std::min(nblk, s * per), hi = std::min(nblk, (s + 1) * per);
      if (R == 1) {
        float* acc = parts.data() + (b0 * S + s) * part;
        attend_blocks<T>(qf.data(), kp, vp, tp + b0 * MB, L, lo, hi, BS, Hkv, Hq, D,
                         block_stride, heads_by_kv.data(), group_start.data(), (float)scale, acc,
                         acc + Hq * D, acc + Hq * D + Hq, sc, kb, vb);
        continue;
      }
      const int64_t H = R * Hq;
      head_len.resize(H);
      for (int64_t r = 0; r < R; ++r) std::fill_n(head_len.data() + r * Hq, Hq, lp[b0 + r]);
      state.resize(H * (D + 2));
      float *acc = state.data(), *mx = acc + H * D, *den = mx + H;
      attend_blocks<T>(qf.data(), kp, vp, tp + b0 * MB, L, lo, hi, BS, Hkv, H, D, block_stride,
                       run_heads[R].data(), run_groups[R].data(), (float)scale, acc, mx, den, sc,
                       kb, vb, head_len.data());
      for (int64_t r = 0; r < R; ++r) {  // into each row's (row, split) slot
        float* p = parts.data() + ((b0 + r) * S + s) * part;
        std::copy_n(acc + r * Hq * D, Hq * D, p);
        std::copy_n(mx + r * Hq, Hq, p + Hq * D);
        std::copy_n(den + r * Hq, Hq, p + Hq * D + Hq);
      }
    }
  });
  // merge the splits of each sequence: rescale every partial to the common max
  team::parallel_for(0, B, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t h = 0; h < Hq; ++h) {
        float m = -INFINITY;
        for (int64_t s = 0; s < S; ++s) m = std::max(m, parts[(b * S + s) * part + Hq * D + h]);
        std::fill(o.begin(), o.end(), 0.f);
        float den = 0.f;
        for (int64_t s = 0; s < S; ++s) {
          const float* p = parts.data() + (b * S + s) * part;
          const float ms = p[Hq * D + h];
          if (ms == -INFINITY) continue;  // an empty split
          const float w = S == 1 ? 1.f : std::exp(ms - m);
          den += p[Hq * D + Hq + h] * w;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) o[i] += p[h * D + i] * w;
        }
        const float inv = den > 0.f ? 1.f / den : 0.f;
        for (int64_t i = 0; i < D; ++i) op[(b * Hq + h) * D + i] = from_f<T>(o[i] * inv);
      }
    }
  });
}

// Rows in parallel: r = x, or residual + x stored back into residual (at storage precision
// first, as torch's `residual + x` does) when residual is given; out = rms_norm(r) * weight.
// add_rms_norm_ passes out = x; rms_norm (the first layer's norm, no residual yet) passes none,
// so both norms are one computation. Why C++ for the plain norm too: torch's rms_norm is a
// composite of ~6 ops, each dispatched cold after a decode step's weight stream has evicted the
// caches: 100-110 us a batch-1 step against 22-25 for this call (SmolLM2, 1024 in, 3 x 150
// steps, perf_counter around the call; AMD EPYC Zen 5).
template <typename T>
void rms_norm_rows(const torch::Tensor& x, T* residual, torch::Tensor& out,
                   const torch::Tensor& weight, double eps) {
  const int64_t H = x.size(-1), N = x.numel() / H;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  team::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> r(H);
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = xp + row * H;
      if (residual != nullptr) {
        T* rr = residual + row * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) {
          const T sum = from_f<T>(to_f(rr[i]) + to_f(xr[i]));
          rr[i] = sum;
          r[i] = to_f(sum);
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) r[i] = to_f(xr[i]);
      }
      const float ss = sum_squares(r.data(), H);
      const float inv = 1.f / std::sqrt(ss / (float)H + (float)eps);
      T* orow = op + row * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) orow[i] = from_f<T>(to_f(wp[i]) * (r[i] * inv));
    }
  });
}

// silu(x) = x / (1 + exp(-x)) of one row into s[0, n), the exponential as exp_any's (exp of
// -|x|, inverted for x < 0). SIMD builds: 16 lanes at a time with the vector polynomial (GCC
// did not vectorize the scalar loop for AVX2: 1024 x 1536 took 8.0 ms there, torch's silu *
// up 1.4 ms; AMD EPYC Zen 3, 2 threads), then the tail in scalar code.
inline void silu_row(const float* x, float* s, int64_t n) {
  int64_t i = 0;
#if defined(TPLLM_SIMD16)
  using namespace simd;
  const F16 one = set1(1.f), zero = set1(0.f);
  for (; i + 16 <= n; i += 16) {
    const F16 v = load(x + i);
    const F16 en = exp_nonpositive(zero - max(v, zero - v));  // exp(-|x|)
    store(s + i, v / (one + where_nonnegative(v, en, one / en)));
  }
#endif
  for (; i < n; ++i) s[i] = x[i] / (1.f + exp_any(-x[i]));
}

// out[t, i] = silu(gate[t, i]) * up[t, i] for gate_up = [gate | up] rows. Rounds where torch's
// `F.silu(gate) * up` rounds (silu's result, then the product) so bf16 matches the reference.
template <typename T>
void silu_mul_impl(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t N = out.size(0), I = out.size(1);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  team::parallel_for(0, N, std::max<int64_t>(1, 16384 / I), [&](int64_t begin, int64_t end) {
    std::vector<float> gate(std::is_same_v<T, float> ? 0 : I), silu(I);
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gp + t * 2 * I;
      const T* u = g + I;
      T* o = op + t * I;
      const float* gf;
      if constexpr (std::is_same_v<T, float>) {
        gf = g;
      } else {
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) gate[i] = to_f(g[i]);
        gf = gate.data();
      }
      silu_row(gf, silu.data(), I);
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = from_f<T>(to_f(from_f<T>(silu[i])) * to_f(u[i]));
    }
  });
}

template <typename T>
void rotary_write_kv_impl(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          int64_t Hq, int64_t Hkv, torch::Tensor& k_cache, torch::Tensor& v_cache,
                          const torch::Tensor& slots) {
  const int64_t T_ = qkv.size(0), D = cos.size(1), half = D / 2, W = qkv.size(1);
  T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t* slp = slots.data_ptr<int64_t>();
  const int64_t row = Hkv * D;  // one token's K (or V) in the cache
  team::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* x = xp + t * W;
      const T* c = cp + t * D;
      const T* s = sp + t * D;
      for (int64_t h = 0; h < Hq + Hkv; ++h) {
        T* v = x + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(v[i]), x2 = to_f(v[i + half]);
          // Each product rounded to storage precision before the sum, like the torch reference.
          const float a1 = to_f(from_f<T>(x1 * to_f(c[i])));
          const float b1 = to_f(from_f<T>((-x2) * to_f(s[i])));
          const float a2 = to_f(from_f<T>(x2 * to_f(c[i + half])));
          const float b2 = to_f(from_f<T>(x1 * to_f(s[i + half])));
          v[i] = from_f<T>(a1 + b1);
          v[i + half] = from_f<T>(a2 + b2);
        }
      }
      std::memcpy(kc + slp[t] * row, x + Hq * D, row * sizeof(T));
      std::memcpy(vc + slp[t] * row, x + (Hq + Hkv) * D, row * sizeof(T));
    }
  });
}

// Publishes `seq` in this rank's flag (flags: `line` int64s per rank), then spins until every
// rank has published it, at most max_spins pauses per rank; false if one had not by then.
inline bool publish_and_wait(int64_t* flags, int64_t line, int64_t world, int64_t rank,
                             int64_t seq, int64_t max_spins) {
  __atomic_store_n(flags + rank * line, seq, __ATOMIC_RELEASE);
  for (int64_t r = 0; r < world; ++r) {
    int64_t spins = 0;
    while (__atomic_load_n(flags + r * line, __ATOMIC_ACQUIRE) < seq) {
      if (++spins > max_spins) return false;
      team::cpu_relax();
    }
  }
  return true;
}

template <typename T>
void sum_slots(const T* slots, int64_t world, int64_t stride, int64_t n, T* out) {
  // every rank adds the slots in rank order, in fp32: bit-identical results on every rank
  constexpr int64_t kChunk = 1024;
  float acc[kChunk];
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t m = std::min(kChunk, n - c0);
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) acc[i] = to_f(slots[c0 + i]);
    for (int64_t r = 1; r < world; ++r) {
      const T* src = slots + r * stride + c0;
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) acc[i] += to_f(src[i]);
    }
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) out[c0 + i] = from_f<T>(acc[i]);
  }
}

// out (contiguous, out.numel() elements) = the sum of every rank's slot
void sum_slots_into(const torch::Tensor& slots, torch::Tensor& out) {
  if (out.scalar_type() == torch::kBFloat16)
    sum_slots(slots.data_ptr<bf16>(), slots.size(0), slots.size(1), out.numel(),
              out.data_ptr<bf16>());
  else
    sum_slots(slots.data_ptr<float>(), slots.size(0), slots.size(1), out.numel(),
              out.data_ptr<float>());
}

}  // namespace

// q [B, Hq, D]; caches [NB, BS, Hkv, D]; block_tables [B, MB]; context_lens [B];
// kv_index [Hq] (local KV head of each query head); num_splits per context (0 = by batch size
// and threads) -> out [B, Hq, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale, torch::Tensor kv_index, int64_t num_splits) {
  auto out = torch::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  paged_decode_attention_into(q, k_cache, v_cache, block_tables, context_lens, scale, kv_index,
                              num_splits, out);
  return out;
}

// The same into out [B, Hq, D] (contiguous); q's rows may be strided (a view into the fused
// qkv rows), each row's [Hq, D] contiguous.
void paged_decode_attention_into(torch::Tensor q, const torch::Tensor& k_cache,
                                 const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                 const torch::Tensor& context_lens, double scale,
                                 const torch::Tensor& kv_index, int64_t num_splits,
                                 torch::Tensor& out) {
  check_storage(q, "paged_decode_attention");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: contiguous caches only");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_decode_attention: q and the caches must share a dtype");
  if (q.dim() != 3 || q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() &&
              out.scalar_type() == q.scalar_type(), "paged_decode_attention: out like q");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto kvi = kv_index.contiguous();
  if (q.scalar_type() == torch::kBFloat16)
    decode_attention_impl<bf16>(q, k_cache, v_cache, tables, lens, scale, kvi, num_splits, out);
  else
    decode_attention_impl<float>(q, k_cache, v_cache, tables, lens, scale, kvi, num_splits, out);
}

// residual += x; x = rms_norm(residual) * weight   (both in place, rows in parallel)
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_storage(x, "add_rms_norm_");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() &&
              residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm_: contiguous tensors of one dtype only");
  if (x.scalar_type() == torch::kBFloat16)
    rms_norm_rows<bf16>(x, residual.data_ptr<bf16>(), x, weight, eps);
  else
    rms_norm_rows<float>(x, residual.data_ptr<float>(), x, weight, eps);
}

// rms_norm(x) * weight into a new tensor (x unchanged): see rms_norm_rows.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_storage(x, "rms_norm");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1),
              "rms_norm: contiguous x and weight of one dtype, weight over x's last dim");
  auto out = torch::empty_like(x);
  if (x.scalar_type() == torch::kBFloat16)
    rms_norm_rows<bf16>(x, nullptr, out, weight, eps);
  else
    rms_norm_rows<float>(x, nullptr, out, weight, eps);
  return out;
}

// qkv [T, (Hq + 2*Hkv) * D] contiguous: rotate the q and k heads in place (neox halves layout,
// cos/sin [T, D] with duplicated halves), then store k and v rows at their cache slots.
void rotary_write_kv_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t Hq,
                      int64_t Hkv, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor slot_mapping) {
  check_storage(qkv, "rotary_write_kv_");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
              k_cache.is_contiguous() && v_cache.is_contiguous(),
              "rotary_write_kv_: contiguous tensors only");
  for (const auto* t : {&cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "rotary_write_kv_: one dtype only");
  auto slots = slot_mapping.contiguous();
  if (qkv.scalar_type() == torch::kBFloat16)
    rotary_write_kv_impl<bf16>(qkv, cos, sin, Hq, Hkv, k_cache, v_cache, slots);
  else
    rotary_write_kv_impl<float>(qkv, cos, sin, Hq, Hkv, k_cache, v_cache, slots);
}

// gate_up [N, 2I] contiguous -> silu(gate) * up [N, I]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_mul_into(gate_up, out);
  return out;
}

void silu_mul_into(const torch::Tensor& gate_up, torch::Tensor& out) {
  check_storage(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0 &&
                  out.is_contiguous() && out.scalar_type() == gate_up.scalar_type() &&
                  out.size(0) == gate_up.size(0) && out.size(1) == gate_up.size(1) / 2,
              "silu_mul: a contiguous [N, 2I] tensor only, out [N, I]");
  if (gate_up.scalar_type() == torch::kBFloat16)
    silu_mul_impl<bf16>(gate_up, out);
  else
    silu_mul_impl<float>(gate_up, out);
}

// The shared-memory one-shot all-reduce's hot path (backend/parallel/shm_comm.py): x is copied
// into this rank's slot of the collective's buffer (`slots` [world, slot_elems]; no copy when x
// is that slot: computed there by the caller), the rank publishes `seq` in its flag (`flags`
// int64 [world, 8]: a cache line per rank), spins until every rank has published `seq` (at
// most max_spins pauses, without the GIL), then sums the slots. Returns None if the peers did
// not all arrive in time: the caller then waits its slow way (yielding, checking that the peers
// live) and calls shm_sum. One C++ call instead of several torch ops: each cost up to ~14 us
// when its code had gone cold between collectives.
bool shm_all_reduce_into(const torch::Tensor& x, torch::Tensor& out, const torch::Tensor& slots,
                         const torch::Tensor& flags, int64_t rank, int64_t seq,
                         int64_t max_spins) {
  check_storage(x, "shm_all_reduce");
  TORCH_CHECK(x.is_contiguous() && slots.is_contiguous() && slots.dim() == 2 &&
                  slots.scalar_type() == x.scalar_type() && x.numel() <= slots.size(1) &&
                  flags.scalar_type() == torch::kInt64 && flags.dim() == 2 &&
                  flags.size(0) == slots.size(0) && out.is_contiguous() &&
                  out.numel() == x.numel() && out.scalar_type() == x.scalar_type(),
              "shm_all_reduce: contiguous x within the slot, matching dtypes");
  const int64_t world = slots.size(0), n = x.numel(), stride = slots.size(1);
  // the wait without the GIL (called from Python, or from a kernel that released it already)
  std::optional<pybind11::gil_scoped_release> no_gil;
  if (PyGILState_Check()) no_gil.emplace();
  char* mine = static_cast<char*>(slots.data_ptr()) + rank * stride * x.element_size();
  if (mine != x.data_ptr())  // else x was computed in place into this rank's slot
    std::memcpy(mine, x.data_ptr(), n * x.element_size());
  const bool arrived =
      publish_and_wait(flags.data_ptr<int64_t>(), flags.size(1), world, rank, seq, max_spins);
  if (arrived) sum_slots_into(slots, out);  // reads only the slots: out may be x itself
  return arrived;
}

c10::optional<torch::Tensor> shm_all_reduce(torch::Tensor x, torch::Tensor slots,
                                            torch::Tensor flags, int64_t rank, int64_t seq,
                                            int64_t max_spins) {
  auto out = torch::empty_like(x);
  if (!shm_all_reduce_into(x, out, slots, flags, rank, seq, max_spins)) return c10::nullopt;
  return out;
}

// The slots' sum for an x-shaped result, once every rank has published (see shm_all_reduce).
torch::Tensor shm_sum(torch::Tensor x, torch::Tensor slots) {
  check_storage(x, "shm_sum");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == x.scalar_type() &&
                  x.numel() <= slots.size(1), "shm_sum: slots of x's dtype");
  auto out = torch::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  sum_slots_into(slots, out);
  return out;
}

// gather_first's rank-0 side (backend/parallel/shm_comm.py): publishes `seq` (the peers never
// read rank 0's part), spins until every rank has published it (at most max_spins pauses,
// without the GIL), then returns [rows, sum(sizes)]: x (rank 0's [rows, sizes[0]]) and each
// peer r's posted [rows, sizes[r]] side by side. None if a peer was late (the caller waits its
// liveness-checking way, then calls again). One C++ call: the same steps as torch ops took
// ~0.25 ms per decode step on SmolLM2 TP2, their code cold after the lm_head's weight stream.
c10::optional<torch::Tensor> shm_gather_first(const torch::Tensor& x, const torch::Tensor& slots,
                                              const torch::Tensor& flags, int64_t seq,
                                              int64_t max_spins, std::vector<int64_t> sizes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && slots.is_contiguous() && slots.dim() == 2 &&
                  slots.scalar_type() == x.scalar_type() && flags.scalar_type() == torch::kInt64 &&
                  flags.dim() == 2 && flags.size(0) == slots.size(0) &&
                  static_cast<int64_t>(sizes.size()) == slots.size(0) && x.size(1) == sizes[0],
              "shm_gather_first: x [rows, sizes[0]], one size per rank's slot");
  const int64_t world = slots.size(0), rows = x.size(0);
  int64_t total = 0;
  for (int64_t s : sizes) {
    TORCH_CHECK(rows * s <= slots.size(1), "shm_gather_first: a part exceeds its slot");
    total += s;
  }
  std::optional<pybind11::gil_scoped_release> no_gil;
  if (PyGILState_Check()) no_gil.emplace();
  if (!publish_and_wait(flags.data_ptr<int64_t>(), flags.size(1), world, 0, seq, max_spins))
    return c10::nullopt;
  auto out = torch::empty({rows, total}, x.options());
  const int64_t es = x.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < rows; ++i) {
    int64_t col = 0;
    for (int64_t r = 0; r < world; ++r) {
      const char* src = r == 0 ? static_cast<const char*>(x.data_ptr()) + i * sizes[0] * es
                               : static_cast<const char*>(slots.data_ptr()) +
                                     (r * slots.size(1) + i * sizes[r]) * es;
      std::memcpy(dst + (i * total + col) * es, src, sizes[r] * es);
      col += sizes[r];
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_m_linear", &small_m_linear);
  m.def("small_m_linear_into", [](torch::Tensor x, torch::Tensor weight, torch::Tensor y) {
    small_m_linear_into(x, weight, c10::nullopt, y);
  });
  m.def("small_m_linear_q4_into", [](torch::Tensor x, torch::Tensor q, torch::Tensor dm,
                                     c10::optional<torch::Tensor> bias, torch::Tensor y) {
    small_m_linear_q4_into(x, q, dm, bias, y);
  });
  m.def("block_copy_max_rows", &block_copy_max_rows);
  m.def("small_m_linear_q8_into", [](torch::Tensor x, torch::Tensor q, torch::Tensor scales,
                                     c10::optional<torch::Tensor> bias, torch::Tensor y) {
    small_m_linear_q8_into(x, q, scales, bias, y);
  });
  m.def("small_m_linear_bf16", &small_m_linear_bf16);
  m.def("bf16_gemv_supported", &bf16_gemv_supported);
  m.def("q8_screen_inputs", &q8_screen_inputs);
  m.def("greedy_argmax_screened", &greedy_argmax_screened);
  m.def("greedy_argmax_screened_q8", &greedy_argmax_screened_q8);
  bind_decode_layer(m);
  bind_thread_team(m);
  m.def("rotary_write_kv_", &rotary_write_kv_);
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("paged_prefill_attention", &paged_prefill_attention);
  m.def("prefill_attention_supported", &prefill_attention_supported);
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("rms_norm", &rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("shm_all_reduce", &shm_all_reduce);
  m.def("shm_sum", &shm_sum);
  m.def("shm_gather_first", &shm_gather_first);
}
