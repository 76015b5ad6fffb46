// The shared-memory collectives' hot paths (backend/parallel/shm_comm.py): the one-shot
// all-reduce and rank 0's gather. Each rank publishes a sequence number in its flag line and
// spins, without the GIL, until its peers have; the slots are then summed in rank order in fp32,
// so every rank computes the same bits.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <Python.h>  // the GIL only: these functions are bound in bindings.cpp

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_kernels.h"
#include "kernel_common.h"
#include "thread_team.h"

namespace {

// The GIL released for a scope (as pybind11's gil_scoped_release, without pybind11's headers).
class NoGil {
 public:
  NoGil() : state_(PyEval_SaveThread()) {}
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;
  ~NoGil() { PyEval_RestoreThread(state_); }

 private:
  PyThreadState* state_;
};

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
void sum_slots_into(const at::Tensor& slots, at::Tensor& out) {
  if (out.scalar_type() == at::kBFloat16)
    sum_slots(slots.data_ptr<bf16>(), slots.size(0), slots.size(1), out.numel(),
              out.data_ptr<bf16>());
  else
    sum_slots(slots.data_ptr<float>(), slots.size(0), slots.size(1), out.numel(),
              out.data_ptr<float>());
}

}  // namespace

// The shared-memory one-shot all-reduce's hot path (backend/parallel/shm_comm.py): x is copied
// into this rank's slot of the collective's buffer (`slots` [world, slot_elems]; no copy when x
// is that slot: computed there by the caller), the rank publishes `seq` in its flag (`flags`
// int64 [world, 8]: a cache line per rank), spins until every rank has published `seq` (at
// most max_spins pauses, without the GIL), then sums the slots. Returns None if the peers did
// not all arrive in time: the caller then waits its slow way (yielding, checking that the peers
// live) and calls shm_sum. One C++ call instead of several torch ops, each costly when its code
// has gone cold between collectives.
bool shm_all_reduce_into(const at::Tensor& x, at::Tensor& out, const at::Tensor& slots,
                         const at::Tensor& flags, int64_t rank, int64_t seq,
                         int64_t max_spins) {
  check_storage(x, "shm_all_reduce");
  TORCH_CHECK(x.is_contiguous() && slots.is_contiguous() && slots.dim() == 2 &&
                  slots.scalar_type() == x.scalar_type() && x.numel() <= slots.size(1) &&
                  flags.scalar_type() == at::kLong && flags.dim() == 2 &&
                  flags.size(0) == slots.size(0) && out.is_contiguous() &&
                  out.numel() == x.numel() && out.scalar_type() == x.scalar_type(),
              "shm_all_reduce: contiguous x within the slot, matching dtypes");
  const int64_t world = slots.size(0), n = x.numel(), stride = slots.size(1);
  // the wait without the GIL (called from Python, or from a kernel that released it already)
  std::optional<NoGil> no_gil;
  if (PyGILState_Check()) no_gil.emplace();
  char* mine = static_cast<char*>(slots.data_ptr()) + rank * stride * x.element_size();
  if (mine != x.data_ptr())  // else x was computed in place into this rank's slot
    std::memcpy(mine, x.data_ptr(), n * x.element_size());
  const bool arrived =
      publish_and_wait(flags.data_ptr<int64_t>(), flags.size(1), world, rank, seq, max_spins);
  if (arrived) sum_slots_into(slots, out);  // reads only the slots: out may be x itself
  return arrived;
}

c10::optional<at::Tensor> shm_all_reduce(at::Tensor x, at::Tensor slots,
                                            at::Tensor flags, int64_t rank, int64_t seq,
                                            int64_t max_spins) {
  auto out = at::empty_like(x);
  if (!shm_all_reduce_into(x, out, slots, flags, rank, seq, max_spins)) return c10::nullopt;
  return out;
}

// The slots' sum for an x-shaped result, once every rank has published (see shm_all_reduce).
at::Tensor shm_sum(at::Tensor x, at::Tensor slots) {
  check_storage(x, "shm_sum");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == x.scalar_type() &&
                  x.numel() <= slots.size(1), "shm_sum: slots of x's dtype");
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  sum_slots_into(slots, out);
  return out;
}

// gather_first's rank-0 side (backend/parallel/shm_comm.py): publishes `seq` (the peers never
// read rank 0's part), spins until every rank has published it (at most max_spins pauses,
// without the GIL), then returns [rows, sum(sizes)]: x (rank 0's [rows, sizes[0]]) and each
// peer r's posted [rows, sizes[r]] side by side. None if a peer was late (the caller waits its
// liveness-checking way, then calls again). One C++ call: the same steps as torch ops were a
// visible share of a TP2 decode step, their code cold after the lm_head's weight stream.
c10::optional<at::Tensor> shm_gather_first(const at::Tensor& x, const at::Tensor& slots,
                                              const at::Tensor& flags, int64_t seq,
                                              int64_t max_spins, std::vector<int64_t> sizes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && slots.is_contiguous() && slots.dim() == 2 &&
                  slots.scalar_type() == x.scalar_type() && flags.scalar_type() == at::kLong &&
                  flags.dim() == 2 && flags.size(0) == slots.size(0) &&
                  static_cast<int64_t>(sizes.size()) == slots.size(0) && x.size(1) == sizes[0],
              "shm_gather_first: x [rows, sizes[0]], one size per rank's slot");
  const int64_t world = slots.size(0), rows = x.size(0);
  int64_t total = 0;
  for (int64_t s : sizes) {
    TORCH_CHECK(rows * s <= slots.size(1), "shm_gather_first: a part exceeds its slot");
    total += s;
  }
  std::optional<NoGil> no_gil;
  if (PyGILState_Check()) no_gil.emplace();
  if (!publish_and_wait(flags.data_ptr<int64_t>(), flags.size(1), world, 0, seq, max_spins))
    return c10::nullopt;
  auto out = at::empty({rows, total}, x.options());
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
