// The worker team the decode-path kernels run their parallel loops on, instead of torch's
// OpenMP (at::parallel_for): a process-wide team of (at::get_num_threads() - 1) workers plus the
// calling thread. Definitions: thread_team.cpp.
//
// Why: a batch-1 decode step opens ~150 short parallel regions. With OpenMP the caller waits
// for every thread of the region at its barrier: waking sleeping workers (OMP_WAIT_POLICY=
// PASSIVE, the server's setting) costs a large share of each short region, and workers spinning
// without bound starve whatever else needs their core (`python -m client bench decode`;
// docs/decisions.md, "The C++ kernels run on their own worker team"). Here the caller never
// waits for a worker that has not started: a loop is cut into chunks, one contiguous segment of
// them per thread (the caller's included), each thread claims its own segment's chunks in order
// (one memory stream, as a static split) and then steals the chunks left at the back of the
// others', so a worker that is late (asleep, or descheduled by another process) simply gets
// fewer or none. Between loops a worker spins a bounded
// time (TPLLM_SPIN_US, default kDefaultSpinUs), then sleeps on a futex until the next loop is
// published. While another process contends for the cores (a thread of ours was descheduled
// mid-spin or mid-chunk, or a worker was woken on the caller's CPU) the workers sleep right
// after each loop instead, and a worker woken on the caller's CPU moves to another one: see
// thread_team.cpp.
//
// Results do not depend on who runs a chunk: every kernel computes each output element inside
// one task, in a fixed order, whatever the split (the same property their at::parallel_for
// form had; the tests compare the two bit for bit).
//
// TPLLM_THREADING=omp (read when the module loads; set_mode at run time) sends every loop back
// to at::parallel_for, exactly the old behaviour.
#pragma once
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

namespace team {

enum class Mode : int { kTeam = 0, kOmp = 1 };
constexpr int64_t kDefaultSpinUs = 100;

// One pause in a spin-wait loop (the team's, the shared-memory all-reduce's): lets the
// sibling hyperthread run and the loop leave the pipeline without a memory-order flush.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

extern std::atomic<int> g_mode;  // a Mode; TPLLM_THREADING at load
inline Mode mode() { return static_cast<Mode>(g_mode.load(std::memory_order_relaxed)); }
void set_mode(Mode m);
int64_t spin_us();  // how long an idle worker spins before it sleeps
void set_spin_us(int64_t us);
// the team's counters since the module loaded, by name (Python: team_stats), and its workers
std::vector<std::pair<const char*, uint64_t>> stats();

using TaskFn = void (*)(const void* ctx, int64_t begin, int64_t end);

// fn(ctx, b, e) over [begin, end) in chunks of at least `grain` indices (fewer only for the
// last), on the team and the calling thread. Runs inline (one call over the whole range) when
// the range is at most `grain`, at::get_num_threads() is 1, the caller is already inside a
// parallel loop (this team's or OpenMP's), or another thread is using the team. The first
// exception a chunk throws is rethrown here once every started chunk has ended.
void run(int64_t begin, int64_t end, int64_t grain, TaskFn fn, const void* ctx);

// The kernels' parallel loop: the team's, or at::parallel_for in omp mode. f(b, e) as
// at::parallel_for's.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (mode() == Mode::kOmp) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  run(begin, end, grain,
      [](const void* c, int64_t b, int64_t e) { (*static_cast<const F*>(c))(b, e); }, &f);
}

}  // namespace team
