// The worker team's Python bindings (thread_team.h): the mode and spin switches, its counters,
// the benchmarks' read probe, and the hooks the tests drive the team through.
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpu_kernels.h"
#include "thread_team.h"

namespace {

// The benchmarks' read-bandwidth probe (client/floors.py): every 64-bit word of `buf` summed,
// each thread of the team one contiguous slice, as a decode GEMV reads its rows. Integer adds
// into 8 independent sums: the compiler vectorizes them for the variant's ISA without
// reassociating floats, so the loop is bound by the loads. Returns the sum (so nothing is
// optimized away); the caller times it. torch's float sum of the same buffer read slower than
// our decode step streamed its weights: too lenient a floor.
int64_t read_probe(const at::Tensor& buf) {
  TORCH_CHECK(buf.device().is_cpu() && buf.is_contiguous() && buf.nbytes() % 64 == 0,
              "read_probe: a contiguous CPU tensor of a multiple of 64 bytes");
  const auto* words = static_cast<const uint64_t*>(buf.data_ptr());
  const int64_t n = static_cast<int64_t>(buf.nbytes() / 8);
  const int64_t parts = std::max<int64_t>(1, at::get_num_threads());
  std::vector<uint64_t> sums(static_cast<size_t>(parts), 0);
  {
    pybind11::gil_scoped_release no_gil;
    team::parallel_for(0, parts, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        // slice bounds on 8-word (64-byte) steps; the last slice ends at n (a multiple of 8)
        const int64_t b = (n * t / parts) & ~int64_t{7};
        const int64_t e = t + 1 == parts ? n : (n * (t + 1) / parts) & ~int64_t{7};
        uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t i = b; i < e; i += 8)
          for (int j = 0; j < 8; ++j) acc[j] += words[i + j];
        uint64_t s = 0;
        for (int j = 0; j < 8; ++j) s += acc[j];
        sums[static_cast<size_t>(t)] = s;
      }
    });
  }
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  return static_cast<int64_t>(total);
}

}  // namespace

// Python: the mode and spin switches, counters, and hooks the tests drive the team through.
void bind_thread_team(pybind11::module& m) {
  namespace py = pybind11;
  m.def("threading_mode", [] { return team::mode() == team::Mode::kOmp ? "omp" : "team"; });
  m.def("set_threading_mode", [](const std::string& mode) {
    TORCH_CHECK(mode == "team" || mode == "omp", "threading mode: team or omp, not ", mode);
    team::set_mode(mode == "omp" ? team::Mode::kOmp : team::Mode::kTeam);
  });
  m.def("team_spin_us", &team::spin_us);
  m.def("read_probe", &read_probe);
  m.def("set_team_spin_us", &team::set_spin_us);
  m.def("team_stats", [] {
    py::dict d;
    for (const auto& [name, value] : team::stats()) d[name] = value;
    return d;
  });
  // Test hooks. _parallel_cover: how many times each index of [0, n) ran (int32 [n]) and, per
  // index, the OS thread that ran it (as a small id); nested: each chunk runs an inner loop over
  // [0, 8) (which must run inline) for every one of its indices.
  m.def("_parallel_cover", [](int64_t n, int64_t grain, bool nested) {
    auto counts = at::zeros({n}, at::kInt);
    auto who = at::zeros({n}, at::kLong);
    int32_t* c = counts.data_ptr<int32_t>();
    int64_t* w = who.data_ptr<int64_t>();
    auto body = [&](int64_t b, int64_t e) {
      const auto me = static_cast<int64_t>(
          std::hash<std::thread::id>{}(std::this_thread::get_id()) & 0x7FFFFFFF);
      for (int64_t i = b; i < e; ++i) {
        if (nested) {
          int64_t inner = 0;
          team::parallel_for(0, 8, 1, [&](int64_t ib, int64_t ie) { inner += ie - ib; });
          if (inner != 8) throw std::runtime_error("nested loop lost indices");
        }
        __atomic_fetch_add(c + i, 1, __ATOMIC_RELAXED);
        w[i] = me;
      }
    };
    {
      py::gil_scoped_release no_gil;
      team::parallel_for(0, n, grain, body);
    }
    return py::make_tuple(counts, who);
  });
  // _parallel_hold: a loop over [0, n) whose chunks each sleep 1 ms on the caller (time for a
  // worker to wake and claim some) and `hold_us` on any other thread (a worker still busy when
  // the caller is done); returns the chunks the workers held
  m.def("_parallel_hold", [](int64_t n, int64_t grain, int64_t hold_us) {
    py::gil_scoped_release no_gil;
    const auto caller = std::this_thread::get_id();
    std::atomic<int64_t> held{0};
    team::parallel_for(0, n, grain, [&](int64_t, int64_t) {
      const bool mine = std::this_thread::get_id() == caller;
      std::this_thread::sleep_for(std::chrono::microseconds(mine ? 1000 : hold_us));
      if (!mine) ++held;
    });
    return held.load();
  });
  // _parallel_throw: a loop over [0, n) whose chunk containing index `at` throws
  m.def("_parallel_throw", [](int64_t n, int64_t grain, int64_t at) {
    py::gil_scoped_release no_gil;
    std::atomic<int64_t> ran{0};
    team::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
      if (b <= at && at < e) throw std::runtime_error("task " + std::to_string(at) + " failed");
      ran += e - b;
    });
    return ran.load();
  });
}
