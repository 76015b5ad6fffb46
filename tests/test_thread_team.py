"""The C++ kernels' worker team (tpllm_kernels/csrc/thread_team.h): every index of a loop runs
exactly once whoever runs it, nested and empty loops, exceptions, one thread, concurrent callers, fork;
the mode and spin switches; and the kernels and a decode compute the same bits on the team as on
OpenMP (at::parallel_for). No timing is asserted: who runs which chunk depends on the machine."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tpllm_kernels import cpu_ops, cpu_threading
from tests.required import no_cpu_kernels

if not cpu_ops.AVAILABLE:
    no_cpu_kernels(allow_module_level=True)
ext = cpu_ops._ext
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def team_mode_two_threads():
    """Each test starts in team mode with 2 threads and the default spin, and leaves them so."""
    threads, spin = torch.get_num_threads(), cpu_threading.team_spin_us()
    mode = cpu_threading.threading_mode()
    torch.set_num_threads(2)
    cpu_threading.set_threading_mode("team")
    yield
    torch.set_num_threads(threads)
    cpu_threading.set_threading_mode(mode)
    cpu_threading.set_team_spin_us(spin)


def _cover(n: int, grain: int, nested: bool = False) -> tuple[torch.Tensor, set[int]]:
    counts, who = ext._parallel_cover(n, grain, nested)
    return counts, set(who.tolist())


@pytest.mark.parametrize("n, grain", [(1, 1), (2, 1), (17, 1), (1000, 1), (1000, 7), (1000, 999),
                                      (1000, 1000), (70000, 1), (123457, 64)])
def test_every_index_runs_exactly_once(n, grain):
    jobs = cpu_threading.team_stats()["jobs"]
    counts, _ = _cover(n, grain)
    assert counts.shape == (n,) and torch.equal(counts, torch.ones(n, dtype=torch.int32))
    # a loop over more than its grain is published to the team (else it runs inline)
    assert cpu_threading.team_stats()["jobs"] - jobs == (1 if n > grain else 0)


def test_each_thread_streams_through_one_stretch():
    """A loop's chunks are cut into one contiguous segment per thread (the hardware prefetchers
    follow one stream; turns taken from one counter interleave them). With 2 threads each runs
    a prefix of its own segment, then perhaps chunks stolen from the back of the other's: at
    most 2 runs of consecutive indices per thread, and index 0 always on the caller."""
    _, caller = _cover(1, 1)  # a loop within its grain runs inline: the caller's id
    for _ in range(50):
        counts, who = ext._parallel_cover(1600, 100, False)  # 16 chunks
        assert torch.equal(counts, torch.ones(1600, dtype=torch.int32))
        ids = who.tolist()
        assert ids[0] in caller
        runs: dict[int, int] = {}
        for i, t in enumerate(ids):
            if i == 0 or ids[i - 1] != t:
                runs[t] = runs.get(t, 0) + 1
        assert all(r <= 2 for r in runs.values()), runs


def test_many_loops_in_a_row():
    """Back-to-back loops (the decode step's pattern): workers join late, spin or sleep between."""
    for spin in (0, 5, 200):
        cpu_threading.set_team_spin_us(spin)
        for i in range(300):
            n = 1 + (i * 37) % 500
            counts, _ = _cover(n, 1 + i % 3)
            assert torch.equal(counts, torch.ones(n, dtype=torch.int32)), (spin, i)


def test_empty_range_runs_nothing():
    counts, who = _cover(0, 1)
    assert counts.numel() == 0 and who == set()


def test_nested_loops_run_inline():
    """A loop inside a chunk runs on that chunk's thread, whole (the inner check is in C++)."""
    counts, _ = _cover(500, 1, nested=True)
    assert torch.equal(counts, torch.ones(500, dtype=torch.int32))


def test_an_exception_in_a_task_reaches_the_caller():
    with pytest.raises(RuntimeError, match="task 517 failed"):
        ext._parallel_throw(1000, 1, 517)
    with pytest.raises(RuntimeError, match="task 0 failed"):  # in the caller's own first chunk
        ext._parallel_throw(1000, 1, 0)
    with pytest.raises(RuntimeError, match="task 3 failed"):  # a loop run inline
        ext._parallel_throw(10, 100, 3)
    assert ext._parallel_throw(1000, 1, -1) == 1000  # and the team still works
    counts, _ = _cover(1000, 1)
    assert torch.equal(counts, torch.ones(1000, dtype=torch.int32))


def test_one_thread_runs_everything_on_the_caller():
    torch.set_num_threads(1)
    jobs = cpu_threading.team_stats()["jobs"]
    counts, who = _cover(5000, 1)
    assert torch.equal(counts, torch.ones(5000, dtype=torch.int32))
    assert len(who) == 1 and cpu_threading.team_stats()["jobs"] == jobs  # inline: no job published


def test_concurrent_callers():
    """Two Python threads looping at once: one holds the team, the other runs inline."""
    errors: list[str] = []

    def loop(seed: int) -> None:
        for i in range(200):
            n = 1 + (seed * 101 + i * 13) % 700
            counts, _ = _cover(n, 1)
            if not torch.equal(counts, torch.ones(n, dtype=torch.int32)):
                errors.append(f"thread {seed}, loop {i}")

    threads = [threading.Thread(target=loop, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _runs_on_team() -> bool:
    """Whether a loop of 1000 (each index once) was published to the team, not OpenMP."""
    jobs = cpu_threading.team_stats()["jobs"]
    counts, _ = _cover(1000, 1)
    assert torch.equal(counts, torch.ones(1000, dtype=torch.int32))
    return cpu_threading.team_stats()["jobs"] > jobs


def test_omp_mode_and_switches():
    cpu_threading.set_threading_mode("omp")
    assert cpu_threading.threading_mode() == "omp"
    assert not _runs_on_team()  # at::parallel_for, not the team
    with pytest.raises(RuntimeError, match="task 5 failed"):
        ext._parallel_throw(1000, 1, 5)
    with pytest.raises(RuntimeError, match="team or omp"):
        cpu_threading.set_threading_mode("tbb")
    cpu_threading.set_team_spin_us(123)
    assert cpu_threading.team_spin_us() == 123
    with pytest.raises(RuntimeError, match=">= 0"):
        cpu_threading.set_team_spin_us(-1)


def test_gemm_passes_run_their_loops_on_openmp_while_its_workers_spin(monkeypatch):
    gemv_rows = cpu_ops.SMALL_M
    monkeypatch.setattr(cpu_threading, "_GEMM_PASSES_ON_OMP", True)
    cpu_ops.begin_forward(gemv_rows + 1, torch.float32)  # its linears are GEMMs
    assert not _runs_on_team() and cpu_threading.threading_mode() == "team"
    cpu_ops.begin_forward(gemv_rows, torch.float32)  # all in the C++ kernels
    assert _runs_on_team()
    if cpu_ops.BF16_SMALL_M < gemv_rows:  # bf16 leaves the GEMV sooner
        cpu_ops.begin_forward(gemv_rows, torch.bfloat16)
        assert not _runs_on_team()
    monkeypatch.setattr(cpu_threading, "_GEMM_PASSES_ON_OMP", False)  # OpenMP's workers sleep
    cpu_ops.begin_forward(gemv_rows + 1, torch.float32)
    assert _runs_on_team()
    cpu_threading.set_threading_mode("omp")  # chosen: every pass on OpenMP
    cpu_ops.begin_forward(1, torch.float32)
    assert not _runs_on_team() and cpu_threading.threading_mode() == "omp"


@pytest.mark.parametrize("policy, spincount, spins", [
    ("", "", True), ("active", "", True), ("PASSIVE", "", False), (" passive ", "", False),
    ("", "0", False), ("", "10000", True)])
def test_openmp_workers_spin_by_environment(monkeypatch, policy, spincount, spins):
    monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    monkeypatch.setenv("GOMP_SPINCOUNT", spincount)
    assert cpu_threading.openmp_workers_spin() == spins


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter, the team's variables only as given."""
    base = {k: v for k, v in os.environ.items() if k not in ("TPLLM_THREADING", "TPLLM_SPIN_US")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**base, **env}, timeout=300)


def test_environment_sets_mode_and_spin():
    code = ("from tpllm_kernels import cpu_threading; "
            "print(cpu_threading.threading_mode(), cpu_threading.team_spin_us())")
    assert _python(code).stdout.split() == ["team", "100"]  # the defaults
    proc = _python(code, TPLLM_THREADING="omp", TPLLM_SPIN_US="7")
    assert proc.stdout.split() == ["omp", "7"], proc.stderr[-2000:]
    proc = _python(code, TPLLM_THREADING="bogus", TPLLM_SPIN_US="x")
    assert proc.stdout.split() == ["team", "100"], proc.stderr[-2000:]
    assert "TPLLM_THREADING=bogus" in proc.stderr and "TPLLM_SPIN_US=x" in proc.stderr


def test_a_forked_child_gets_its_own_team():
    """Threads do not survive fork: the child starts a team of its own (no hang, all indices)."""
    code = """
import os, torch
from tpllm_kernels import cpu_ops
torch.set_num_threads(2)
ok = lambda: bool((cpu_ops._ext._parallel_cover(5000, 1, False)[0] == 1).all())
assert ok()
pid = os.fork()
if pid == 0:
    os._exit(0 if ok() and ok() else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert ok()
print("ok")
"""
    proc = _python(code)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def _decode_logits(model_dir: Path, dtype: torch.dtype) -> torch.Tensor:
    from tests.test_model_fidelity import _our_logits
    ids = torch.randint(3, 20000, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    return _our_logits(model_dir, ids, [7, 20, 5] + [1] * 8, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_team_and_omp_compute_the_same_bits(dtype, default_model_dir):
    """SmolLM2 (its layers are big enough to split) through prefill chunks and 8 decode steps
    (float32: the fused decode stack; bf16: the per-op kernels), and every kernel of the ISA
    test on fixed inputs: identical on the team and on OpenMP."""
    from tests.test_cpu_isa import _kernel_outputs
    results = {}
    for mode in ("omp", "team"):
        cpu_threading.set_threading_mode(mode)
        jobs = cpu_threading.team_stats()["jobs"]
        results[mode] = {"logits": _decode_logits(default_model_dir, dtype), **_kernel_outputs()}
        ran_on_team = cpu_threading.team_stats()["jobs"] - jobs
        assert (ran_on_team > 0) == (mode == "team"), (mode, ran_on_team)
    for key, want in results["omp"].items():
        assert torch.equal(results["team"][key], want), key


def test_caller_wait_is_counted():
    """team_stats' caller_wait_ns grows by the time the caller, done with its own chunks, waits
    for a worker's: 16 chunks of 1 ms on the caller, 60 ms on the worker, so the caller is done
    after ~15 ms and waits ~45 for the worker's first chunk. (A worker that never woke in time
    leaves every chunk to the caller: nothing held, nothing to wait for; tried again.)"""
    for _ in range(5):
        waited = cpu_threading.team_stats()["caller_wait_ns"]
        held = ext._parallel_hold(64, 1, 60_000)
        if held:
            assert cpu_threading.team_stats()["caller_wait_ns"] - waited >= 10_000_000
            return
    pytest.skip("the worker took no chunk in 5 loops (a busy machine)")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_probe_sums_every_word_once(threads):
    # the benchmarks' read-bandwidth probe: one slice per thread, the slices cover the buffer
    # exactly (a word read twice or skipped changes the sum), odd sizes included
    g = torch.Generator().manual_seed(0)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for words in (8, 8 * 1001, 8 * 65537):
            buf = torch.randint(-2**62, 2**62, (words,), dtype=torch.int64, generator=g)
            want = int(buf.sum())  # int64 wraps as the probe's uint64 does
            assert ext.read_probe(buf) == want
            assert ext.read_probe(buf.view(torch.float32)) == want
    finally:
        torch.set_num_threads(old)
    with pytest.raises(RuntimeError, match="multiple of 64 bytes"):
        ext.read_probe(torch.zeros(3))
