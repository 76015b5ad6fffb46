// Causal attention of one prompt chunk over its sequence's paged KV cache (float32, head_dim
// 64; written once against simd::F16: AVX-512, or AVX2 + FMA with register tiles half as wide):
// the prefill counterpart of paged_decode_attention.
//
// Why: torch's CPU flash SDPA ran well below the GEMM rate (a large share of a long prompt's
// time to first token) and needs a cached prefix gathered into a copy.
// Here both products are tiled like a GEMM. Scores: 6 rows x 32 keys in registers, the keys
// transposed once per KV head so a key chunk is two vector loads per dim and each query value a
// broadcast. Then one exact softmax per row over all its keys (no online rescaling). Then P.V:
// 6 rows x 64 columns in registers, per chunk of 32 V rows that stays in L1 for all the task's
// rows. Faster than SDPA from 256 to 2048 tokens (docs/decisions.md, "Prefill attention in
// C++"). (head_dim 128 was slower than SDPA with this tiling: not used.)
// Every sum runs in the same order on both ISAs (same bits); AVX2 has 16 registers, not 32, so
// a score tile there is 6 rows x 16 keys and the P.V tile 6 rows x 16 columns at a time.
//
// Work: a task is (KV head, 8 consecutive query positions) for every query head that reads that
// KV head (rows = heads x positions); tasks alternate early/late so both threads get an even
// share of the causal triangle.
//
// Options: a sliding window (position p sees keys (p - window, p]): a task computes only the key
// chunks from its first position's window on, and keys before the chunk's first window are not
// even transposed; Gemma 2's logit soft-cap (a vector tanh per score, only when set).
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attn_simd.h"
#include "thread_team.h"

#if defined(TPLLM_SIMD16)
namespace {

using namespace simd;

constexpr int kRows = 6;   // rows (query head x position) per register tile
constexpr int kKeys = 32;  // keys per V chunk and the padding of a row's keys
// keys per score tile: 32 (two vectors: 12 of AVX-512's 32 registers), 16 on AVX2
constexpr int kTileVecs = 2 / kRegsPerVec;
constexpr int kPos = 8;    // query positions per task

// Both tiles hold their accumulators as hardware registers (simd::Nat: one zmm, or one ymm on
// AVX2), not as F16s: GCC spilled AVX2's arrays of two-register F16s to the stack on every
// iteration, at less than half the speed (docs/decisions.md, "AVX2 register tiles"). Each
// lane's sums are the same either way.
constexpr int kKeyRegs = 16 * kTileVecs / kNatLanes;  // registers per row of a score tile: 2
// registers per row of a P.V tile: all 64 columns of head_dim 64 on AVX-512 (4 zmm: 24 of its
// 32 registers), 16 columns on AVX2 (2 ymm: 12 of 16)
constexpr int kColRegs = kRegsPerVec == 1 ? 4 : 2;

// s[r][k0, k0 + 16 kTileVecs) = scale * q[r] . kt[:, k0 + ...] for the tile's kRows rows; kt
// is [D][ldk] (keys transposed): per dim, kKeyRegs vector loads and a broadcast per row
template <int D>
inline void score_tile(const float* const* q, const float* kt, int64_t ldk, int64_t k0,
                       float scale, float* const* s) {
  Nat acc[kRows][kKeyRegs];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kKeyRegs; ++c) acc[r][c] = nset1(0.f);
  for (int d = 0; d < D; ++d) {
    Nat kv[kKeyRegs];
#pragma GCC unroll 4
    for (int c = 0; c < kKeyRegs; ++c) kv[c] = nload(kt + d * ldk + k0 + kNatLanes * c);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const Nat qb = nset1(q[r][d]);
#pragma GCC unroll 4
      for (int c = 0; c < kKeyRegs; ++c) acc[r][c] = nfma(qb, kv[c], acc[r][c]);
    }
  }
  const Nat sv = nset1(scale);
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kKeyRegs; ++c) nstore(s[r] + k0 + kNatLanes * c, nmul(acc[r][c], sv));
}

// o[r] += sum over keys [k0, k1) of p[r][k] v[k] for the tile's kRows rows (o in memory: the
// tile is reloaded per key chunk, while the chunk's V rows stay in L1 for every tile)
template <int D>
inline void pv_tile(const float* const* p, const float* const* v, int64_t k0, int64_t k1,
                    float* const* o) {
  constexpr int C = kColRegs;
  for (int c0 = 0; c0 < D / kNatLanes; c0 += C) {
    Nat acc[kRows][C];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = nload(o[r] + kNatLanes * (c0 + c));
    for (int64_t k = k0; k < k1; ++k) {
      Nat vv[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) vv[c] = nload(v[k - k0] + kNatLanes * (c0 + c));
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        const Nat pb = nset1(p[r][k]);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[r][c] = nfma(pb, vv[c], acc[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) nstore(o[r] + kNatLanes * (c0 + c), acc[r][c]);
  }
}

template <int D>
void prefill_impl(const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const int64_t* table, int64_t ctx, double scale,
                  const int64_t* kvi, int64_t window, float softcap, at::Tensor& out) {
  const int64_t Tq = q.size(0), Hq = q.size(1), BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t q_tok = q.stride(0), q_head = q.stride(1);
  const int64_t block_stride = k_cache.stride(0), tok_stride = k_cache.stride(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t first = ctx - Tq;  // position of the chunk's first query
  // the first key chunk any query of the chunk sees (0 without a window): keys before it are
  // never read, and kt holds the keys from it on (key t at column t - kt_lo)
  const int64_t kt_lo = attn::window_start(first, window) / kKeys * kKeys;
  const int64_t ldk = (ctx - kt_lo + kKeys - 1) / kKeys * kKeys;
  const int64_t blk_lo = kt_lo / BS, nblk = (ctx + BS - 1) / BS - blk_lo;
  // keys transposed per KV head: kt[kh][d][t], zeros past ctx; kept across calls (no page
  // faults per layer for a fresh buffer); the pool threads use it through this pointer
  static thread_local std::vector<float> kt_buffer;
  kt_buffer.resize(std::max<size_t>(kt_buffer.size(), Hkv * D * ldk));
  float* const kt = kt_buffer.data();
  team::parallel_for(0, Hkv * nblk, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t kh = b / nblk, blk = blk_lo + b % nblk;
      const int64_t j0 = std::max<int64_t>(0, kt_lo - blk * BS);  // within the first block
      const float* src = kp + table[blk] * block_stride + kh * D;
      float* dst = kt + kh * D * ldk + (blk * BS + j0 - kt_lo);
      const int64_t n = std::min(BS, ctx - blk * BS) - j0;
      src += j0 * tok_stride;
      for (int d = 0; d < D; ++d)
        for (int64_t j = 0; j < n; ++j) dst[d * ldk + j] = src[j * tok_stride + d];
    }
  });
  for (int64_t row = 0; row < Hkv * D; ++row)
    std::fill(kt + row * ldk + ctx - kt_lo, kt + (row + 1) * ldk, 0.f);
  std::vector<int64_t> heads_by_kv, group_start;
  group_heads_by_kv(kvi, Hq, Hkv, heads_by_kv, group_start);
  const int64_t qblocks = (Tq + kPos - 1) / kPos;
  team::parallel_for(0, Hkv * qblocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> sbuf, obuf;
    std::vector<const float*> qrow, vrow(kKeys);
    std::vector<float*> srow, orow;
    std::vector<int64_t> limit, start;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t kh = t / qblocks, i = t % qblocks;
      // early and late blocks alternate: contiguous task ranges cost about the same
      const int64_t qb = i % 2 == 0 ? i / 2 : qblocks - 1 - i / 2;
      const int64_t p0 = qb * kPos, P = std::min<int64_t>(kPos, Tq - p0);
      const int64_t G = group_start[kh + 1] - group_start[kh];
      const int64_t R = G * P, tiles = (R + kRows - 1) / kRows, Rp = tiles * kRows;
      const int64_t n = first + p0 + P;  // keys the task's last position sees
      const int64_t npad = (n + kKeys - 1) / kKeys * kKeys;
      // the task's keys are [k_lo, n): k_lo is its first position's window start, down to a
      // chunk; a row's scores are indexed from k_lo
      const int64_t k_lo = attn::window_start(first + p0, window) / kKeys * kKeys;
      const int64_t span = npad - k_lo;
      // rows r = g * P + j: query head g of the group at position p0 + j; the last tile is
      // padded by repeating the last row (computed, never stored)
      sbuf.resize(Rp * span), obuf.assign(Rp * D, 0.f);
      qrow.resize(Rp), srow.resize(Rp), orow.resize(Rp), limit.resize(Rp), start.resize(Rp);
      for (int64_t r = 0; r < Rp; ++r) {
        const int64_t rr = std::min(r, R - 1), h = heads_by_kv[group_start[kh] + rr / P];
        const int64_t pos = p0 + rr % P;
        qrow[r] = qp + pos * q_tok + h * q_head;
        srow[r] = sbuf.data() + r * span;
        orow[r] = obuf.data() + r * D;
        limit[r] = first + pos + 1 - k_lo;
        start[r] = attn::window_start(first + pos, window) - k_lo;
      }
      const float* ktk = kt + kh * D * ldk + (k_lo - kt_lo);
      for (int64_t k0 = 0; k0 < span; k0 += 16 * kTileVecs)
        for (int64_t tile = 0; tile < tiles; ++tile)
          score_tile<D>(qrow.data() + tile * kRows, ktk, ldk, k0, (float)scale,
                        srow.data() + tile * kRows);
      if (softcap > 0.f)
        for (int64_t r = 0; r < Rp; ++r) softcap_row(srow[r], span, softcap);
      std::vector<float> inv(Rp);
      for (int64_t r = 0; r < Rp; ++r)
        inv[r] = 1.f / softmax_row(srow[r], limit[r], span, start[r]).sum;
      for (int64_t k0 = k_lo; k0 < n; k0 += kKeys) {
        const int64_t k1 = std::min(n, k0 + kKeys);
        for (int64_t k = k0; k < k1; ++k)
          vrow[k - k0] = vp + table[k / BS] * block_stride + (k % BS) * tok_stride + kh * D;
        for (int64_t tile = 0; tile < tiles; ++tile)
          pv_tile<D>(srow.data() + tile * kRows, vrow.data(), k0 - k_lo, k1 - k_lo,
                     orow.data() + tile * kRows);
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = heads_by_kv[group_start[kh] + r / P], pos = p0 + r % P;
        const F16 iv = set1(inv[r]);
        for (int c = 0; c < D / 16; ++c)
          store(op + (pos * Hq + h) * D + 16 * c, load(orow[r] + 16 * c) * iv);
      }
    }
  });
}

}  // namespace
#endif

bool prefill_attention_supported(int64_t head_dim) {
#if defined(TPLLM_SIMD16)
  return head_dim == 64;  // 128 (6 x 8 P.V accumulators) needs its own tiling: SDPA for now
#else
  (void)head_dim;
  return false;
#endif
}

// q [Tq, Hq, D] (any row and head strides, unit stride within a head) are the chunk's last Tq
// positions of a sequence whose first `context_len` tokens (the chunk included) are in the
// float32 caches [blocks, BS, Hkv, D] at `block_table`; window: position p sees keys
// (p - window, p] (0: all up to p); softcap: logits softcap * tanh(logit / softcap) (0: none).
// Returns [Tq, Hq, D].
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache,
                                   at::Tensor v_cache, at::Tensor block_table,
                                   int64_t context_len, double scale, at::Tensor kv_index,
                                   int64_t window, double softcap) {
  const int64_t D = q.size(2);
  TORCH_CHECK(prefill_attention_supported(D), "paged_prefill_attention: head_dim 64 with "
              "AVX2 or AVX-512 only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && q.stride(2) == 1 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(3) == D,
              "paged_prefill_attention: float32, contiguous caches, unit stride within a head");
  TORCH_CHECK(q.size(0) <= context_len && block_table.numel() * k_cache.size(1) >= context_len,
              "paged_prefill_attention: the block table must cover context_len >= chunk length");
  TORCH_CHECK(window >= 0 && softcap >= 0.0,
              "paged_prefill_attention: window and softcap must be >= 0 (0: none)");
  auto out = at::empty({q.size(0), q.size(1), D}, q.options());
  auto table = block_table.to(at::kLong).contiguous();
  auto kvi = kv_index.to(at::kLong).contiguous();
#if defined(TPLLM_SIMD16)
  prefill_impl<64>(q, k_cache, v_cache, table.data_ptr<int64_t>(), context_len, scale,
                   kvi.data_ptr<int64_t>(), window, static_cast<float>(softcap), out);
#endif
  return out;
}
