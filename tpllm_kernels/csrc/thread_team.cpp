// The worker team of thread_team.h: publishing a loop, handing out its chunks, parking and
// waking the workers (its Python bindings: thread_team_bindings.cpp).
//
// One loop (a "job") at a time: the caller that holds the team writes the job's fields, then
// publishes one segment word per participant (the caller is participant 0, worker w is w + 1)
// and bumps the futex word `epoch`. The job's n chunks are cut into those contiguous segments;
// a segment word is (epoch, front, back): its owner claims chunk `front` by compare-and-swap to
// front + 1, and a participant whose own segment is empty steals chunk back - 1 of another by
// moving `back` down. So each thread streams through one contiguous stretch of the weights, as
// a static split would (chunks handed out in turn from one counter interleave the threads'
// stretches, and the hardware prefetchers restart at every chunk: docs/decisions.md, "One
// contiguous segment of chunks per thread"), while a participant that is late
// (asleep, or descheduled) still holds up nothing it has not claimed. Because the epoch travels
// in the same word as the indices, a worker that was descheduled for a whole job and wakes up
// late can never claim a chunk of a job that has ended (its CAS fails), and the fields it then
// reads are those of a job that cannot end before its chunk is counted in `done`: the caller
// waits for the chunks that were claimed, and only for those.
#include "thread_team.h"

#include <pthread.h>
#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpu_kernels.h"

#if defined(__linux__)
#include <sched.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace team {

namespace {

int read_mode_env() {
  const char* v = std::getenv("TPLLM_THREADING");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "team") == 0) return 0;
  if (std::strcmp(v, "omp") == 0) return 1;
  // a typo must not silently pick a mode: say so once, keep the default
  std::fprintf(stderr, "TPLLM_THREADING=%s: expected team or omp; using team\n", v);
  return 0;
}

int64_t read_spin_env() {
  const char* v = std::getenv("TPLLM_SPIN_US");
  if (v == nullptr || *v == '\0') return kDefaultSpinUs;
  char* end = nullptr;
  const long long us = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || us < 0) {
    std::fprintf(stderr, "TPLLM_SPIN_US=%s: expected microseconds >= 0; using %lld\n", v,
                 static_cast<long long>(kDefaultSpinUs));
    return kDefaultSpinUs;
  }
  return us;
}

std::atomic<int64_t> g_spin_ns{read_spin_env() * 1000};

// chunks per participating thread: enough that a late or preempted thread's share is taken over
// by the others in small pieces, few enough that claiming them (a CAS on one cache line) stays
// negligible next to a chunk (the grain keeps chunks from getting tinier than the caller wants)
constexpr int64_t kChunksPerThread = 8;
constexpr int64_t kMaxChunks = 0xFFFF;  // the front and back fields of a segment are 16 bits
constexpr int kMaxSegments = 64;        // participants beyond share segments (p % 64)

// Contention: another process wants our cores. Seen as a thread of ours descheduled for longer
// than kStallNs (a spinning worker, or the caller asleep waiting for a worker's chunk: longer
// than a VM's wake-up jitter, shorter than another process's time slice), or a worker woken on
// the caller's own CPU (no other was free). For kContendedNs after that the workers do not spin
// between loops: a spinning worker used up its share of a contended CPU and was then preempted
// inside its next chunk, and the caller waited for the rest of the other process's time slice
// (`python -m client bench decode` with the other core busy; docs/decisions.md, "Under
// contention workers stop spinning").
constexpr int64_t kStallNs = 500 * 1000;
constexpr int64_t kContendedNs = 100 * 1000 * 1000;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Sleep while *word == expected (a spurious return is fine: callers re-check); wake sleepers.
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
#else
  if (word->load() == expected) std::this_thread::sleep_for(std::chrono::microseconds(50));
#endif
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
#else
  (void)word;
#endif
}

// a segment word: epoch (32 bits) | front: its next chunk from the start (16) | back: one past
// its last unclaimed chunk (16); empty when front >= back
inline uint64_t pack(uint32_t epoch, uint64_t front, uint64_t back) {
  return (static_cast<uint64_t>(epoch) << 32) | (front << 16) | back;
}
inline uint64_t front_of(uint64_t s) { return (s >> 16) & 0xFFFF; }
inline uint64_t back_of(uint64_t s) { return s & 0xFFFF; }
inline uint32_t epoch_of(uint64_t s) { return static_cast<uint32_t>(s >> 32); }

struct alignas(64) Segment {
  std::atomic<uint64_t> word{0};
};

thread_local bool t_in_task = false;  // inside a chunk: nested loops run inline

struct Stats {
  std::atomic<uint64_t> jobs{0}, inline_runs{0}, chunks{0}, worker_chunks{0}, wakes{0},
      parks{0}, caller_sleeps{0}, caller_sleep_ns{0}, long_sleeps{0}, spin_stalls{0},
      moved_off{0}, sat_out{0}, contended{0},
      caller_wait_ns{0};  // the caller done with its chunks, waiting for the workers' (sleeps too)
};

struct Team {
  // the current job: written by the caller before it publishes `next`, read after a claim
  TaskFn fn = nullptr;
  const void* ctx = nullptr;
  int64_t begin = 0, end = 0, chunk = 1;
  uint32_t chunks = 0;  // n: the job's chunk count
  // the job's segment words in use (atomic: a worker that found its own segment empty reads it
  // unclaimed, perhaps as the next job is written; what it then reads there is all empty)
  std::atomic<int> segments{1};
  std::exception_ptr error;

  Segment seg[kMaxSegments];
  alignas(64) std::atomic<uint32_t> done{0};      // chunks of the current job finished
  std::atomic<uint32_t> caller_waiting{0};        // the caller sleeps on `done`
  std::atomic<int> caller_cpu{-1};                // where the caller published the job
  std::atomic<int64_t> contended_until{0};        // no spinning before this (now_ns)
  std::atomic<bool> failed{false};
  std::atomic_flag error_taken = ATOMIC_FLAG_INIT;
  alignas(64) std::atomic<uint32_t> epoch{0};     // futex word: bumped per job
  std::atomic<int> sleepers{0};                   // workers asleep (or about to be) on `epoch`
  std::atomic<int> active{0};                     // workers [0, active) take part in jobs
  alignas(64) std::mutex caller;                  // one calling thread at a time
  int spawned = 0;                                // workers started (under `caller`)
  Stats stats;

  void spawn(int wanted);
  void note_contention() {
    contended_until.store(now_ns() + kContendedNs, std::memory_order_relaxed);
    stats.contended.fetch_add(1, std::memory_order_relaxed);
  }
  void worker_loop(int index);
  // participant p's chunks of the job published as epoch e, then any others left (from the
  // back of each other segment); returns how many it ran
  int64_t work(uint32_t e, int p);
  void run_chunk(uint64_t i, uint64_t n);
};

std::atomic<Team*> g_team{nullptr};

void after_fork_in_child() {
  // the child has no workers (threads do not survive fork) and perhaps a held mutex: a fresh
  // team, the old one leaked (its workers exist only in the parent)
  g_team.store(new Team());
}

Team& the_team() {
  static Team* t = [] {
    Team* p = new Team();  // never destroyed: detached workers may outlive static destructors
    g_team.store(p);
    pthread_atfork(nullptr, nullptr, after_fork_in_child);
    return p;
  }();
  (void)t;
  return *g_team.load(std::memory_order_acquire);
}

int current_cpu() {
#if defined(__linux__)
  return sched_getcpu();
#else
  return -1;
#endif
}

// A worker that finds itself on the caller's CPU would only take turns with the caller there
// (this happens when the other cores are busy: woken, the worker is placed beside its waker).
// It moves to another CPU it may run on: its affinity without that CPU for a moment (the
// kernel migrates it at once), then its own affinity again, so that it can still be pulled to
// a CPU that goes idle later. False if it cannot (no other CPU allowed).
bool move_off(int cpu) {
#if defined(__linux__)
  cpu_set_t own, others;
  if (cpu < 0 || cpu >= CPU_SETSIZE ||
      pthread_getaffinity_np(pthread_self(), sizeof(own), &own) != 0)
    return false;
  others = own;
  CPU_CLR(cpu, &others);
  if (CPU_COUNT(&others) == 0 ||
      pthread_setaffinity_np(pthread_self(), sizeof(others), &others) != 0)
    return false;
  pthread_setaffinity_np(pthread_self(), sizeof(own), &own);
  return current_cpu() != cpu;
#else
  (void)cpu;
  return false;
#endif
}

void Team::run_chunk(uint64_t i, uint64_t n) {
  const int64_t b = begin + static_cast<int64_t>(i) * chunk;
  const int64_t e = std::min(end, b + chunk);
  if (!failed.load(std::memory_order_relaxed)) {
    try {
      t_in_task = true;
      c10::ParallelGuard guard(true);  // torch ops inside a chunk run inline, as in OpenMP's
      fn(ctx, b, e);
      t_in_task = false;
    } catch (...) {
      t_in_task = false;
      if (!error_taken.test_and_set()) error = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  }
  // the chunk's writes (and `error`) happen-before the caller sees it counted. seq_cst, as the
  // caller_waiting load after it: pairs with the caller's store of that flag, then done load.
  // (n: the job's chunk count, read after the claim: the next job may overwrite it once this is
  // counted)
  if (done.fetch_add(1) + 1 == n && caller_waiting.load()) futex_wake_all(&done);
}

int64_t Team::work(uint32_t e, int p) {
  int64_t ran = 0;
  // its own segment from the front (an ascending stream), then the others' from their backs
  const int segs = segments.load(std::memory_order_relaxed);
  const int own = p % segs;
  for (int k = 0; k < segs; ++k) {
    const int q = (own + k) % segs;
    std::atomic<uint64_t>& w = seg[q].word;
    uint64_t s = w.load(std::memory_order_acquire);
    for (;;) {
      if (epoch_of(s) != e) return ran;  // the job has ended: every chunk was claimed
      const uint64_t f = front_of(s), b = back_of(s);
      if (f >= b) break;
      const bool from_front = k == 0;
      const uint64_t claimed = from_front ? pack(e, f + 1, b) : pack(e, f, b - 1);
      if (w.compare_exchange_weak(s, claimed, std::memory_order_acq_rel,
                                  std::memory_order_acquire)) {
        run_chunk(from_front ? f : b - 1, chunks);
        ++ran;
        s = w.load(std::memory_order_acquire);
      }
    }
  }
  return ran;
}

void Team::worker_loop(int index) {
  uint32_t seen = epoch.load();
  bool park_now = false;  // sat out the last job on the caller's CPU: do not spin there
  for (;;) {
    // wait for a job after `seen`: spin a bounded time (only if this worker takes part), then
    // sleep on the futex until the caller publishes one
    int64_t t = now_ns();
    const bool spin = !park_now && t >= contended_until.load(std::memory_order_relaxed);
    const int64_t spin_ns = spin ? g_spin_ns.load(std::memory_order_relaxed) : 0;
    park_now = false;
    uint32_t e = epoch.load(std::memory_order_acquire);
    if (e == seen && index < active.load(std::memory_order_relaxed) && spin_ns > 0) {
      const int64_t until = t + spin_ns;
      for (int k = 1; (e = epoch.load(std::memory_order_acquire)) == seen; ++k) {
        cpu_relax();
        if (k % 64 == 0) {
          const int64_t t1 = now_ns();
          if (t1 - t > kStallNs) {  // descheduled while spinning: someone else wants this CPU
            stats.spin_stalls.fetch_add(1, std::memory_order_relaxed);
            note_contention();
            break;
          }
          if (t1 > until) break;
          t = t1;
        }
      }
    }
    while (e == seen) {
      stats.parks.fetch_add(1, std::memory_order_relaxed);
      sleepers.fetch_add(1);  // seq_cst: pairs with the caller's epoch store, then sleepers load
      if ((e = epoch.load()) == seen) futex_wait(&epoch, seen);
      sleepers.fetch_sub(1);
      e = epoch.load(std::memory_order_acquire);
    }
    seen = e;
    if (index >= active.load(std::memory_order_relaxed)) continue;  // not in this job's team
    const int cpu = current_cpu();
    if (cpu >= 0 && cpu == caller_cpu.load(std::memory_order_relaxed)) {
      note_contention();
      if (move_off(cpu)) {
        stats.moved_off.fetch_add(1, std::memory_order_relaxed);
      } else {  // nowhere else to run: leave the job (and the core) to the caller
        stats.sat_out.fetch_add(1, std::memory_order_relaxed);
        park_now = true;
        continue;
      }
    }
    const int64_t ran = work(e, index + 1);
    if (ran) stats.worker_chunks.fetch_add(ran, std::memory_order_relaxed);
  }
}

void Team::spawn(int wanted) {
  for (; spawned < wanted; ++spawned) {
    const int index = spawned;
    std::thread([this, index] { worker_loop(index); }).detach();
  }
}

}  // namespace

std::atomic<int> g_mode{read_mode_env()};

void set_mode(Mode m) { g_mode.store(static_cast<int>(m)); }

int64_t spin_us() { return g_spin_ns.load() / 1000; }

void set_spin_us(int64_t us) {
  TORCH_CHECK(us >= 0, "spin_us must be >= 0");
  g_spin_ns.store(us * 1000);
}

void run(int64_t begin, int64_t end, int64_t grain, TaskFn fn, const void* ctx) {
  if (begin >= end) return;
  const int64_t range = end - begin;
  grain = std::max<int64_t>(1, grain);
  const int threads = at::get_num_threads();
  Team& t = the_team();
  std::unique_lock<std::mutex> hold(t.caller, std::defer_lock);
  if (range <= grain || threads <= 1 || t_in_task || at::in_parallel_region() ||
      !hold.try_lock()) {
    t.stats.inline_runs.fetch_add(1, std::memory_order_relaxed);
    at::internal::ThreadIdGuard tid(0);
    c10::ParallelGuard guard(true);
    const bool outer = t_in_task;
    t_in_task = true;
    try {
      fn(ctx, begin, end);
    } catch (...) {
      t_in_task = outer;
      throw;
    }
    t_in_task = outer;
    return;
  }
  t.spawn(threads - 1);
  t.active.store(threads - 1, std::memory_order_relaxed);
  const int64_t want = std::min({(range + grain - 1) / grain, threads * kChunksPerThread,
                                 kMaxChunks});
  const int64_t chunk = (range + want - 1) / want;
  const uint64_t n = static_cast<uint64_t>((range + chunk - 1) / chunk);
  const int segments = std::min(threads, kMaxSegments);

  // the fields, then (release) the claimable segments, then the futex word the workers watch
  t.fn = fn, t.ctx = ctx, t.begin = begin, t.end = end, t.chunk = chunk;
  t.chunks = static_cast<uint32_t>(n);
  t.segments.store(segments, std::memory_order_relaxed);
  t.error = nullptr;
  t.error_taken.clear();
  t.failed.store(false, std::memory_order_relaxed);
  t.done.store(0, std::memory_order_relaxed);
  t.caller_cpu.store(current_cpu(), std::memory_order_relaxed);
  const uint32_t e = t.epoch.load(std::memory_order_relaxed) + 1;
  for (int q = 0; q < segments; ++q)
    t.seg[q].word.store(pack(e, n * q / segments, n * (q + 1) / segments),
                        std::memory_order_release);
  t.epoch.store(e);  // seq_cst: pairs with a worker's sleepers increment, then epoch load
  if (t.sleepers.load() > 0) {
    futex_wake_all(&t.epoch);
    t.stats.wakes.fetch_add(1, std::memory_order_relaxed);
  }
  t.stats.jobs.fetch_add(1, std::memory_order_relaxed);
  t.stats.chunks.fetch_add(n, std::memory_order_relaxed);

  // the caller's share, timed: a running worker finishes its last chunk within about a chunk's
  // time, so the caller spins that long (at least the workers' spin) before it sleeps
  const int64_t t0 = now_ns();
  const int64_t mine = t.work(e, 0);
  const int64_t t1 = now_ns();
  const int64_t per_chunk = mine > 0 ? (t1 - t0) / mine : 0;
  if (t.done.load(std::memory_order_acquire) != n) {
    const int64_t until = now_ns() + std::max<int64_t>(2 * per_chunk, g_spin_ns.load());
    for (int k = 1; t.done.load(std::memory_order_acquire) != n; ++k) {
      cpu_relax();
      if (k % 64 == 0 && now_ns() > until) {
        // a worker holds a started chunk but is not running (preempted): sleep, freeing this
        // core for it; the worker that counts the last chunk wakes us
        t.stats.caller_sleeps.fetch_add(1, std::memory_order_relaxed);
        const int64_t slept = now_ns();
        t.caller_waiting.store(1);
        uint32_t d;
        while ((d = t.done.load()) != n) futex_wait(&t.done, d);
        t.caller_waiting.store(0);
        const int64_t dt = now_ns() - slept;
        t.stats.caller_sleep_ns.fetch_add(dt, std::memory_order_relaxed);
        if (dt > kStallNs) {
          t.stats.long_sleeps.fetch_add(1, std::memory_order_relaxed);
          t.note_contention();
        }
        break;
      }
    }
    t.stats.caller_wait_ns.fetch_add(now_ns() - t1, std::memory_order_relaxed);
  }
  std::exception_ptr err = t.error;
  hold.unlock();
  if (err) std::rethrow_exception(err);
}

std::vector<std::pair<const char*, uint64_t>> stats() {
  const Team& t = the_team();
  const Stats& s = t.stats;
  return {{"jobs", s.jobs.load()},
          {"inline_runs", s.inline_runs.load()},
          {"chunks", s.chunks.load()},
          {"worker_chunks", s.worker_chunks.load()},
          {"wakes", s.wakes.load()},
          {"parks", s.parks.load()},
          {"caller_sleeps", s.caller_sleeps.load()},
          {"caller_sleep_ns", s.caller_sleep_ns.load()},
          {"long_sleeps", s.long_sleeps.load()},
          {"spin_stalls", s.spin_stalls.load()},
          {"moved_off", s.moved_off.load()},
          {"sat_out", s.sat_out.load()},
          {"contended", s.contended.load()},
          {"caller_wait_ns", s.caller_wait_ns.load()},
          {"workers", static_cast<uint64_t>(t.spawned)}};
}

}  // namespace team
