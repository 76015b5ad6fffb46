"""Where the C++ kernels run their parallel loops: on the module's own worker team or on torch's
OpenMP (at::parallel_for). Results are the same bits either way.

The team (csrc/thread_team.h): workers spin a bounded time between loops, then sleep; the
caller never waits for a worker that has not started. It is the mode unless TPLLM_THREADING=omp
(read when the module loads; set_threading_mode changes it at run time, for the whole process).

A pass that runs its linears as GEMMs (more rows than the C++ GEMV takes: prefill chunks, full
decode batches) runs them on torch's OpenMP threads, and unless OMP_WAIT_POLICY=PASSIVE (or
GOMP_SPINCOUNT=0) libgomp's workers spin for milliseconds after each GEMM: on a core they
would share with a team worker through every attention, norm and activation in between. So
in the team mode such a pass sends its loops to OpenMP as well (place_loops), and a pass the
C++ kernels run whole (decode steps up to SMALL_M rows) keeps the team. Under
OMP_WAIT_POLICY=PASSIVE (the server's) each OpenMP loop wakes sleeping workers, so there the
team keeps them. Measured on the 64-row decode steps of `python -m client bench offline`, each
step's mode alternated (docs/decisions.md, "GEMM passes run their loops on OpenMP")."""
from __future__ import annotations

import os

from tpllm_kernels.cpu_ext import load

_ext = load()
AVAILABLE = _ext is not None


def openmp_workers_spin() -> bool:
    """Whether libgomp's workers spin between parallel regions in this process (its default
    and ACTIVE) rather than sleep at once (PASSIVE, or a spin count of 0)."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().upper()
    return policy != "PASSIVE" and os.environ.get("GOMP_SPINCOUNT", "").strip() != "0"


_chosen = _ext.threading_mode() if AVAILABLE else "omp"  # TPLLM_THREADING / set_threading_mode
_GEMM_PASSES_ON_OMP = openmp_workers_spin()


def threading_mode() -> str:
    """'team' or 'omp', as chosen ('omp' also when the C++ kernels are off: torch's own ops are
    OpenMP). In the team mode a GEMM pass may still run its loops on OpenMP: place_loops."""
    return _chosen


def set_threading_mode(mode: str) -> None:
    global _chosen
    if AVAILABLE:
        _ext.set_threading_mode(mode)
        _chosen = mode


def gemm_passes_on_omp() -> bool:
    """Whether, in the team mode, passes that run GEMMs send their loops to OpenMP."""
    return _chosen == "team" and _GEMM_PASSES_ON_OMP


def place_loops(gemm_pass: bool) -> None:
    """Before a forward pass: its loops on OpenMP if it runs GEMMs and OpenMP's workers spin
    (gemm_passes_on_omp), else in the chosen mode."""
    if AVAILABLE and _chosen == "team":
        _ext.set_threading_mode("omp" if gemm_pass and gemm_passes_on_omp() else "team")


def team_spin_us() -> int:
    """How long an idle worker spins for the next loop before it sleeps (microseconds)."""
    return _ext.team_spin_us() if AVAILABLE else 0


def set_team_spin_us(us: int) -> None:
    if AVAILABLE:
        _ext.set_team_spin_us(int(us))


def team_stats() -> dict:
    """Counters since the module loaded: loops published (jobs), loops run inline, chunks and
    those the workers ran, futex wakes of sleeping workers, worker parks, caller sleeps, and
    the nanoseconds the caller waited, its own chunks done, for the workers' (caller_wait_ns)."""
    return dict(_ext.team_stats()) if AVAILABLE else {}
