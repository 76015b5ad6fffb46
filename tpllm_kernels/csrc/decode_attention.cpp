// Paged decode attention on the CPU: each sequence's query heads against its KV blocks, read in
// place from the paged cache (no gather), flash-decoding splits merged in a fixed order; a
// head_dim that is a multiple of 16 (64, 128, 256, ...) through attn_simd.h's two-pass vector
// kernel in the AVX2 and AVX-512 builds, the portable block steps below otherwise. Storage
// float32 or bfloat16, arithmetic float32; the torch reference is tpllm_kernels/reference.py's
// decode_attention. Options: a sliding window (the query at position L - 1 sees keys
// [L - window, L); blocks wholly before it are not read) and Gemma 2's logit soft-cap.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "attn_simd.h"
#include "cpu_kernels.h"
#include "kernel_common.h"
#include "thread_team.h"
#include "vec.h"

namespace {

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

// The portable block steps (the build without AVX2 or AVX-512, or a head_dim not a multiple of
// 16). Query heads heads[0, G) (all reading KV head kh) against one block of n tokens, head_dim
// D a multiple of 16: each K/V row is loaded once for the whole group and the group's
// accumulators stay in vector registers across the block.
template <int D, int GMAX>
void block_group_fast(const float* qf, const float* kblk, const float* vblk, int64_t n,
                      int64_t row, int64_t kh, const int64_t* heads, int64_t G, float scale,
                      float cap, float* acc, float* mx, float* den, float* sc, int64_t BS) {
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
    if (cap > 0.f) attn::softcap_scores(sc + h * BS, n, cap);
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
                                int64_t G, float scale, float cap, float* acc, float* mx,
                                float* den, float* sc, int64_t BS) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = heads[g];
    float* s = sc + h * BS;
    for (int64_t j = 0; j < n; ++j) s[j] = dot(qf + h * D, kblk + j * row + kh * D, D) * scale;
    if (cap > 0.f) attn::softcap_scores(s, n, cap);
    const float corr = softmax_update(s, n, mx[h], den[h]);
    float* a = acc + h * D;
    if (corr != 1.f) {
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) a[i] *= corr;
    }
    for (int64_t j = 0; j < n; ++j) axpy(a, vblk + j * row + kh * D, s[j], D);
  }
}

// Whether head_dim D runs attn_simd.h's two-pass kernel: a multiple of 16 in a SIMD build (its
// vectors are 16 floats); else the portable block steps above
inline bool simd_head_dim(int64_t D) {
#if defined(TPLLM_SIMD16)
  return D > 0 && D % 16 == 0;
#else
  (void)D;
  return false;
#endif
}

// One task: the query heads of one sequence against its KV blocks [blk_begin, blk_end), online
// softmax block by block. Leaves unnormalised acc [Hq, D], running max mx [Hq] and denominator
// den [Hq]. A block is [BS, Hkv, D] contiguous and is read once, in order; the block two ahead
// (blocks are scattered: the hardware prefetcher stops at them) is prefetched meanwhile.
// heads_by_kv lists the query heads grouped by the KV head they read, group kh at
// [group_start[kh], group_start[kh + 1]). lim: the window's first token (the range starts at
// its block; here the tokens before it in that block are skipped), soft-cap, per-head limits.
template <typename T>
void attend_blocks(const float* qf, const T* kp, const T* vp, const int64_t* table, int64_t L,
                   int64_t blk_begin, int64_t blk_end, int64_t BS, int64_t Hkv, int64_t Hq,
                   int64_t D, int64_t block_stride, const int64_t* heads_by_kv,
                   const int64_t* group_start, float scale, float* acc, float* mx, float* den,
                   std::vector<float>& sc, std::vector<float>& kb, std::vector<float>& vb,
                   const attn::KeyLimits& lim) {
#if defined(TPLLM_SIMD16)
  if (simd_head_dim(D)) {  // float32, or bf16 rows widened as they are loaded
    using S = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;
    const S* ks = reinterpret_cast<const S*>(kp);
    const S* vs = reinterpret_cast<const S*>(vp);
    // the common sizes unrolled (the query chunks' loop a constant), any other the same code
    // with the chunk count at run time: the same bits
    auto run = [&](auto chunks) {
      simd::attend_blocks_simd<decltype(chunks)::value>(
          qf, ks, vs, table, L, blk_begin, blk_end, BS, Hkv, Hq, D, block_stride, heads_by_kv,
          group_start, scale, acc, mx, den, sc, lim);
    };
    switch (D) {
      case 64: run(std::integral_constant<int, 4>{}); break;
      case 128: run(std::integral_constant<int, 8>{}); break;
      case 256: run(std::integral_constant<int, 16>{}); break;
      default: run(std::integral_constant<int, 0>{});
    }
    return;
  }
#endif
  TORCH_CHECK(lim.head_len == nullptr && lim.head_start == nullptr,
              "attend_blocks: per-head limits need the SIMD path (head_dim a multiple of 16)");
  const int64_t row = Hkv * D;
  std::fill(acc, acc + Hq * D, 0.f);
  std::fill(mx, mx + Hq, -INFINITY);
  std::fill(den, den + Hq, 0.f);
  sc.resize(Hq * BS);
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t blk_i = blk_begin; blk_i < blk_end; ++blk_i) {
    // the window's first block from its first token on: a block's rows are contiguous, so a
    // suffix of it is a block of n rows of its own
    const int64_t skip = std::clamp<int64_t>(lim.start - blk_i * BS, 0, BS);
    const int64_t n = std::min(BS, L - blk_i * BS) - skip;
    if (n <= 0) continue;
    const T* kbase = kp + table[blk_i] * block_stride + skip * row;
    const T* vbase = vp + table[blk_i] * block_stride + skip * row;
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
          block_group_fast<64, 4>(qf, kblk, vblk, n, row, kh, heads, G, scale, lim.softcap,
                                  acc, mx, den, sc.data(), BS);
        } else if (D == 128) {
          G = std::min<int64_t>(left, 2);
          block_group_fast<128, 2>(qf, kblk, vblk, n, row, kh, heads, G, scale, lim.softcap,
                                   acc, mx, den, sc.data(), BS);
        } else {
          G = left;
          block_group_generic(qf, kblk, vblk, n, row, D, kh, heads, G, scale, lim.softcap,
                              acc, mx, den, sc.data(), BS);
        }
        g += G;
      }
    }
  }
}

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& tables,
                           const at::Tensor& lens, double scale, const at::Tensor& kvi,
                           int64_t num_splits, int64_t window, float softcap, at::Tensor& out) {
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
  // explicit num_splits: each context (its window's blocks) in that many even parts (tests);
  // else fixed-size parts, at multiples of `fixed` blocks from the sequence's first block (not
  // from its window's: a row's splits then stay where they are as its window moves on), only
  // those that reach into the window
  const int64_t fixed = std::max<int64_t>(1, kTokensPerSplit / BS);
  // the block of sequence b's window start: the blocks before it are never read
  auto window_block = [&](int64_t b) { return attn::window_start(lp[b] - 1, window) / BS; };
  int64_t max_splits = 1;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nblk = (lp[b] + BS - 1) / BS;
    max_splits = std::max(max_splits, (nblk + fixed - 1) / fixed - window_block(b) / fixed);
  }
  const int64_t S = num_splits > 0 ? num_splits : max_splits;
  std::vector<int64_t> heads_by_kv, group_start;
  group_heads_by_kv(ip, Hq, Hkv, heads_by_kv, group_start);
  // Runs: consecutive rows of one sequence (a decode verifying drafts: 1 + drafts rows, the same
  // block table, lengths one apart) attend in one task per split, each row's heads as heads of
  // their own (attend_blocks_simd's head_len), so a KV block is read once for all of them, not
  // once per row: faster for long contexts, no change once a layer's K/V fits L2
  // (docs/decisions.md, "Speculation verify rows share KV reads"). Only with fixed splits (a
  // row's splits then do not depend on its run) and the SIMD kernel, and with a window
  // only rows whose windows start in the same block (each then reads the blocks it reads alone):
  // a row's result is the same bits as alone.
  const bool runs_ok = num_splits <= 0 && simd_head_dim(D);
  std::vector<int64_t> run_start{0};
  for (int64_t b = 1; b < B; ++b) {
    const int64_t r0 = run_start.back();
    const bool joins = runs_ok && b - r0 < kMaxRunRows && lp[b] == lp[b - 1] + 1 &&
                       window_block(b) == window_block(r0) &&
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
    std::vector<int64_t> head_len, head_start;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t run = task / S, s = task % S, b0 = run_start[run];
      const int64_t R = run_start[run + 1] - b0, L = lp[b0 + R - 1];
      const int64_t nblk = (L + BS - 1) / BS, wblk = window_block(b0);
      int64_t lo, hi;  // this split's blocks, [lo, hi) within [wblk, nblk)
      if (num_splits > 0) {
        const int64_t per = (nblk - wblk + S - 1) / S;
        lo = std::min(nblk, wblk + s * per), hi = std::min(nblk, wblk + (s + 1) * per);
      } else {
        const int64_t split = wblk / fixed + s;
        lo = std::min(nblk, std::max(wblk, split * fixed));
        hi = std::min(nblk, (split + 1) * fixed);
      }
      qf.resize(R * Hq * D);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < Hq * D; ++i) qf[r * Hq * D + i] = to_f(qp[(b0 + r) * q_rows + i]);
      attn::KeyLimits lim;
      lim.softcap = softcap;
      if (R == 1) {
        lim.start = attn::window_start(L - 1, window);
        float* acc = parts.data() + (b0 * S + s) * part;
        attend_blocks<T>(qf.data(), kp, vp, tp + b0 * MB, L, lo, hi, BS, Hkv, Hq, D,
                         block_stride, heads_by_kv.data(), group_start.data(), (float)scale, acc,
                         acc + Hq * D, acc + Hq * D + Hq, sc, kb, vb, lim);
        continue;
      }
      const int64_t H = R * Hq;
      head_len.resize(H), head_start.resize(H);
      for (int64_t r = 0; r < R; ++r) {
        std::fill_n(head_len.data() + r * Hq, Hq, lp[b0 + r]);
        std::fill_n(head_start.data() + r * Hq, Hq, attn::window_start(lp[b0 + r] - 1, window));
      }
      lim.head_len = head_len.data(), lim.head_start = head_start.data();
      state.resize(H * (D + 2));
      float *acc = state.data(), *mx = acc + H * D, *den = mx + H;
      attend_blocks<T>(qf.data(), kp, vp, tp + b0 * MB, L, lo, hi, BS, Hkv, H, D, block_stride,
                       run_heads[R].data(), run_groups[R].data(), (float)scale, acc, mx, den, sc,
                       kb, vb, lim);
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

}  // namespace

#if defined(TPLLM_SIMD16)
std::atomic<bool> simd::g_attention_touch_pass{true};
#endif

void set_attention_touch_pass(bool on) {
#if defined(TPLLM_SIMD16)
  simd::g_attention_touch_pass.store(on, std::memory_order_relaxed);
#else
  (void)on;
#endif
}

bool attention_touch_pass() {
#if defined(TPLLM_SIMD16)
  return simd::g_attention_touch_pass.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// q [B, Hq, D]; caches [NB, BS, Hkv, D]; block_tables [B, MB]; context_lens [B];
// kv_index [Hq] (local KV head of each query head); num_splits per context (0 = fixed-size
// splits); window: keys [L - window, L) of a context of L (0 = all); softcap: logits
// softcap * tanh(logit / softcap) (0 = none) -> out [B, Hq, D].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens,
                                  double scale, at::Tensor kv_index, int64_t num_splits,
                                  int64_t window, double softcap) {
  auto out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  paged_decode_attention_into(q, k_cache, v_cache, block_tables, context_lens, scale, kv_index,
                              num_splits, out, window, softcap);
  return out;
}

// The same into out [B, Hq, D] (contiguous); q's rows may be strided (a view into the fused
// qkv rows), each row's [Hq, D] contiguous.
void paged_decode_attention_into(at::Tensor q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                 const at::Tensor& context_lens, double scale,
                                 const at::Tensor& kv_index, int64_t num_splits,
                                 at::Tensor& out, int64_t window, double softcap) {
  check_storage(q, "paged_decode_attention");
  TORCH_CHECK(window >= 0 && softcap >= 0.0,
              "paged_decode_attention: window and softcap must be >= 0 (0: none)");
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
  const float cap = static_cast<float>(softcap);
  if (q.scalar_type() == at::kBFloat16)
    decode_attention_impl<bf16>(q, k_cache, v_cache, tables, lens, scale, kvi, num_splits, window,
                                cap, out);
  else
    decode_attention_impl<float>(q, k_cache, v_cache, tables, lens, scale, kvi, num_splits,
                                 window, cap, out);
}
