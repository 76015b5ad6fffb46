// The LoRA adapters' deltas of one linear for a decode step's few rows, every adapter of the step
// in one call: y[m] += B[a] @ (A[a] @ x[m]) for each row m whose adapter a = ids[m] is not 0.
//
// Why: the fused decode stack (decode_layer.cpp) adds them after each projection without a
// return to Python, and the modular path calls the same kernel for its few-row steps, so the two
// compute the same bits. Per adapter group in Python it was two small kernel calls per group per
// projection, and the step left the fused path (`python -m client bench lora`).
//
// The weights of all adapters of a linear are stacked (lora_layers.LoraSlot.stacked), the scale
// folded into B:
//   a    [n, Rmax, in]: adapter i's A rows, one r_i-row block per output segment it targets
//   bt   [n, rmax, out]: B transposed, zero where adapter i leaves an output row as it is
//   info [n, 2 + 3 S] int64: r_i (0: adapter i does not target this linear), its A rows, then
//        per output segment (q/k/v, gate/up, or the one of o/down) its [begin, end) output rows
//        and the offset of its r_i shrunk values (-1: not targeted)
// A merged projection's adapter thus reads only its own segments' B (no zero blocks).
//
// Sums: shrink t[j] = A[j] . x as the float32 GEMV sums a weight row (small_m_gemm.h's FmaTile);
// expand y[o] += (sum over j in order of t[j] * B[o][j]) for each output o, one lane per o:
// neither depends on the batch, the thread split or the ISA variant.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_kernels.h"
#include "small_m_gemm.h"

namespace {

// the per-call scratch, kept by the calling thread (an allocation between the GEMVs is slow)
struct Scratch {
  std::vector<int64_t> order, group_start;  // rows by adapter; group g = order[start[g], start[g+1])
  std::vector<int64_t> group_adapter, task_start;
  std::vector<const float*> xg;              // each group's rows of x, contiguous
  std::vector<float> x, t;                   // gathered rows (non-contiguous groups); shrunk values
};

inline float mul_add(float a, float b, float c) {
#if defined(TPLLM_SIMD16)
  return std::fma(a, b, c);  // the vector lanes' fused multiply-add
#else
  return a * b + c;
#endif
}

}  // namespace

void lora_delta_into(const at::Tensor& x, at::Tensor& y, const at::Tensor& a,
                     const at::Tensor& bt, const at::Tensor& info, const at::Tensor& ids) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
              "lora_delta: x [M, in] and y [M, out]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                  a.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat &&
                  x.is_contiguous() && y.is_contiguous() && a.is_contiguous() &&
                  bt.is_contiguous(),
              "lora_delta: contiguous float32 x, y, a, bt");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.size(0) == bt.size(0) &&
                  a.size(2) == x.size(1) && bt.size(2) == y.size(1),
              "lora_delta: a [n, Rmax, in], bt [n, rmax, out]");
  TORCH_CHECK(info.scalar_type() == at::kLong && info.is_contiguous() && info.dim() == 2 &&
                  info.size(0) == a.size(0) && info.size(1) >= 5 && (info.size(1) - 2) % 3 == 0,
              "lora_delta: info [n, 2 + 3 S] int64");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.dim() == 1 &&
                  ids.size(0) >= x.size(0),
              "lora_delta: ids [>= M] int64");
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t n = a.size(0), Rmax = a.size(1), rmax = bt.size(1);
  const int64_t S = (info.size(1) - 2) / 3, ld_info = info.size(1);
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int64_t* inf = info.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(idp[m] >= 0 && idp[m] <= n, "lora_delta: adapter id out of range");

  // the caller's scratch, by reference (the team's workers have their own thread_local ones)
  thread_local Scratch scratch;
  Scratch& s = scratch;
  // groups: each adapter present that targets this linear, its rows in order
  s.order.clear(), s.group_start.clear(), s.group_adapter.clear(), s.task_start.assign(1, 0);
  for (int64_t i = 1; i <= n; ++i) {
    const int64_t* row = inf + (i - 1) * ld_info;
    if (row[0] <= 0) continue;
    TORCH_CHECK(row[0] <= rmax && row[1] <= Rmax, "lora_delta: rank beyond the stacked weights");
    for (int64_t seg = 0; seg < S; ++seg) {
      const int64_t* sg = row + 2 + 3 * seg;
      TORCH_CHECK(0 <= sg[0] && sg[0] <= sg[1] && sg[1] <= N && sg[2] + row[0] <= row[1],
                  "lora_delta: a segment outside the stacked weights");
    }
    const int64_t begin = static_cast<int64_t>(s.order.size());
    for (int64_t m = 0; m < M; ++m)
      if (idp[m] == i) s.order.push_back(m);
    if (static_cast<int64_t>(s.order.size()) == begin) continue;
    s.group_start.push_back(begin);
    s.group_adapter.push_back(i - 1);
    s.task_start.push_back(s.task_start.back() + row[1]);  // one shrink task per A row
  }
  const int64_t G = static_cast<int64_t>(s.group_adapter.size());
  if (G == 0) return;
  s.group_start.push_back(static_cast<int64_t>(s.order.size()));
  const int64_t P = static_cast<int64_t>(s.order.size());

  // each group's rows of x, contiguous: in place when they are (a step's rows come sorted by
  // adapter), else gathered
  s.xg.resize(G);
  const float** xg = s.xg.data();
  const float* xp = x.data_ptr<float>();
  s.x.resize(P * K);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t b = s.group_start[g], e = s.group_start[g + 1];
    if (s.order[e - 1] - s.order[b] == e - b - 1) {
      xg[g] = xp + s.order[b] * K;
    } else {
      for (int64_t p = b; p < e; ++p)
        std::copy(xp + s.order[p] * K, xp + (s.order[p] + 1) * K, s.x.data() + p * K);
      xg[g] = s.x.data() + b * K;
    }
  }

  // shrink: t[p, j] = A[a][j] . x[order[p]], one task per (group, A row), each A row read once
  // for the group's rows, 4 rows at a time where a chunk has them (more loads in flight; each
  // t[p, j] summed the same way either way), with the GEMV's L2 prefetch ahead (an adapter's
  // block is a short stream, tens of KB)
  s.t.resize(P * Rmax);
  float* tp = s.t.data();
  const float* ap = a.data_ptr<float>();
  const char* a_end = reinterpret_cast<const char*>(ap + a.numel());
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(float));
  const int64_t tasks = s.task_start.back();
  const int64_t shrink_grain = std::max<int64_t>(1, 65536 / row_bytes);
  team::parallel_for(0, tasks, shrink_grain, [&](int64_t k0, int64_t k1) {
    int64_t g = 0;
    for (int64_t k = k0; k < k1;) {
      while (k >= s.task_start[g + 1]) ++g;
      const int64_t j = k - s.task_start[g], b = s.group_start[g];
      const int64_t rows = std::min<int64_t>(k1, s.task_start[g + 1]) - k >= 4 ? 4 : 1;
      const float* w = ap + (s.group_adapter[g] * Rmax + j) * K;
      const char* ahead = reinterpret_cast<const char*>(w) + small_m::kPrefetchAhead;
      if (ahead < a_end) small_m::prefetch_l2(ahead, std::min(rows * row_bytes, a_end - ahead));
      const int64_t cnt = s.group_start[g + 1] - b;
      if (rows == 4)
        small_m::rows_by_inputs<small_m::FmaTile, 4>(w, xg[g], cnt, K, tp + b * Rmax + j, Rmax);
      else
        small_m::rows_by_inputs<small_m::FmaTile, 1>(w, xg[g], cnt, K, tp + b * Rmax + j, Rmax);
      k += rows;
    }
  });

  // expand: blocks of 64 outputs; in each, every group's targeted segments within it
  constexpr int64_t kBlock = 64;
  constexpr int64_t kExpandAhead = 64;  // floats: 4 lines ahead in each of B's r row streams
  const float* bp = bt.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  int64_t rank_rows = 0;  // B floats one output takes over the groups' rows
  for (int64_t g = 0; g < G; ++g) rank_rows += inf[s.group_adapter[g] * ld_info];
  const int64_t expand_grain = std::max<int64_t>(
      1, 65536 / (kBlock * rank_rows * static_cast<int64_t>(sizeof(float))));
  team::parallel_for(0, (N + kBlock - 1) / kBlock, expand_grain, [&](int64_t q0, int64_t q1) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t ai = s.group_adapter[g];
      const int64_t* row = inf + ai * ld_info;
      const int64_t r = row[0];
      const float* B = bp + ai * rmax * N;
      for (int64_t seg = 0; seg < S; ++seg) {
        const int64_t o_begin = row[2 + 3 * seg], o_end = row[3 + 3 * seg];
        const int64_t off = row[4 + 3 * seg];
        if (off < 0) continue;
        const int64_t lo = std::max(o_begin, q0 * kBlock), hi = std::min(o_end, q1 * kBlock);
        // 16 outputs at a time for every row of the group: B's r lines come from memory once
        // (prefetched a few lines ahead in each of its r streams), then from L1
        int64_t o = lo;
#if defined(TPLLM_SIMD16)
        for (; o + 16 <= hi; o += 16) {
          if (o + kExpandAhead < hi)
            for (int64_t j = 0; j < r; ++j) small_m::prefetch_l2(B + j * N + o + kExpandAhead, 4);
          for (int64_t p = s.group_start[g]; p < s.group_start[g + 1]; ++p) {
            const float* t = tp + p * Rmax + off;
            float* yr = yp + s.order[p] * N + o;
            simd::F16 acc = simd::set1(0.f);
            for (int64_t j = 0; j < r; ++j)
              acc = simd::fma(simd::set1(t[j]), simd::load(B + j * N + o), acc);
            simd::store(yr, simd::load(yr) + acc);
          }
        }
#else
        for (; o + 16 <= hi; o += 16)
          for (int64_t p = s.group_start[g]; p < s.group_start[g + 1]; ++p) {
            const float* t = tp + p * Rmax + off;
            float* yr = yp + s.order[p] * N + o;
            v16f acc = {};
            for (int64_t j = 0; j < r; ++j) acc = t[j] * load16(B + j * N + o) + acc;
            store16(yr, load16(yr) + acc);
          }
#endif
        for (; o < hi; ++o)  // each output as a vector lane sums it
          for (int64_t p = s.group_start[g]; p < s.group_start[g + 1]; ++p) {
            const float* t = tp + p * Rmax + off;
            float acc = 0.f;
            for (int64_t j = 0; j < r; ++j) acc = mul_add(t[j], B[j * N + o], acc);
            yp[s.order[p] * N + o] += acc;
          }
      }
    }
  });
}
