"""A tensor-parallel group on one host: rank 0 lives in this process, ranks 1..N-1 are worker
processes it starts and owns.

Start-up: rank 0 creates the rendezvous store (a torch FileStore in a private temp directory: no
port is opened) and the shared-memory segment, then spawns the workers (same Python, `spawn`
start method). The gloo fallback group for messages too large for shared memory is formed
through the store only if such a message ever comes (comm_select.LazyGloo). Every rank loads
only its own weight shards and allocates its own KV cache. Each step, rank 0 sends the step's inputs to every
worker as one pickled message over a pipe; all ranks then run the same forward pass, meeting in
the collectives. Workers exit when rank 0 says so, when their pipe closes (rank 0 died), or when
a collective notices rank 0 is gone; close() kills any straggler, so none outlives the engine.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.parallel.comm_select import connect, local_segment, rendezvous_store
from backend.parallel.context import ParallelContext
from backend.parallel.shm_comm import PeerLostError

log = logging.getLogger("backend.parallel")
STARTUP_TIMEOUT_S = 600.0


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its rank (picklable)."""
    rank: int
    world: int
    store_path: str  # the FileStore rendezvous file
    shm_name: str
    slot_bytes: int
    model_dir: str
    dtype: str
    num_blocks: int
    block_size: int
    max_model_len: int
    num_threads: int | None
    cpu: int | None  # core to pin to, or None
    # GPU path (comm_select.py): rank r on the r-th GPU from `device`; decode CUDA graphs
    device: str = "cpu"
    cuda_graphs: bool = False
    decode_sizes: tuple[int, ...] = ()


def python_executable() -> str:
    """The interpreter for workers. Inside Triton's Python-backend stub sys.executable is the stub
    itself, so prefer $TPLLM_PYTHON, then a real python, then the environment's bin/python3."""
    exe = os.environ.get("TPLLM_PYTHON") or sys.executable
    if exe and Path(exe).name.startswith("python") and Path(exe).exists():
        return exe
    fallback = Path(sys.prefix) / "bin" / "python3"
    return str(fallback if fallback.exists() else exe)


class TPGroup:
    def __init__(self, spec: WorkerSpec, dtype: torch.dtype):
        """Start the group described by rank 0's `spec` (workers load their shards meanwhile)."""
        self.spec, self.dtype = spec, dtype
        self.world = spec.world
        self.ctx = ParallelContext(0, spec.world, None)  # the model keeps this object for good
        self.closed = True
        self._start()

    def _start(self) -> None:
        self._procs: list[mp.process.BaseProcess] = []
        self._conns = []
        self._store_dir = tempfile.mkdtemp(prefix="tpllm-tp-")
        self.comm = None
        self.closed = False
        try:  # a start that fails half-way still removes what it made (segment, store, workers)
            self._spawn_workers()
        except BaseException:
            self.close()
            raise
        log.info("tensor-parallel group of %d formed (workers %s)", self.world, self.worker_pids)

    def _spawn_workers(self) -> None:
        # communicator by device (comm_select): the CPU segment now, the rest once workers run
        self.comm = local_segment(self.spec, self.dtype, self.workers_alive)
        self.ctx.comm = self.comm
        timeout = datetime.timedelta(seconds=STARTUP_TIMEOUT_S)
        store_path = os.path.join(self._store_dir, "store")
        self._store = rendezvous_store(store_path, self.world, timeout)
        ctx = mp.get_context("spawn")
        ctx.set_executable(python_executable())
        from backend.parallel.worker import worker_main
        for rank in range(1, self.world):
            parent, child = ctx.Pipe()
            spec = WorkerSpec(**{**self.spec.__dict__, "rank": rank,
                                 "store_path": store_path,
                                 "shm_name": self.comm.name if self.comm else "",
                                 "cpu": None if self.spec.cpu is None else rank % os.cpu_count()})
            proc = ctx.Process(target=worker_main, args=(spec, child, os.getpid()),
                               name=f"tpllm-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self.comm = self.ctx.comm = connect(self.spec, self._store, self.dtype, timeout,
                                            self.workers_alive, self.comm)

    def restart(self) -> None:
        """Replace the workers (after one died): rank 0's model keeps its context object, which
        gets the new communicator; the workers reload their shards."""
        self.close()
        self._start()
        self.wait_ready()

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self._conns, start=1):
            while not conn.poll(0.1):
                if not self._procs[rank - 1].is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited during start-up "
                                       f"(exit code {self._procs[rank - 1].exitcode})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel rank {rank} not ready in {timeout:.0f}s")
            try:
                status, detail = conn.recv()
            except (EOFError, OSError):  # it died before reporting (e.g. a failed spawn)
                self._procs[rank - 1].join(1.0)
                raise RuntimeError(f"tensor-parallel rank {rank} exited during start-up (exit "
                                   f"code {self._procs[rank - 1].exitcode}); its stderr says why"
                                   ) from None
            if status != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {detail}")

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def workers_alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def broadcast(self, step) -> None:
        """Send one step to every worker: one pickled message each."""
        payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise PeerLostError(f"a tensor-parallel worker is gone ({e})") from None

    def close(self, timeout: float = 5.0) -> None:
        if self.closed:
            return
        self.closed = True
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for conn in self._conns:
            conn.close()
        if self.comm is not None:
            self.comm.close(unlink=True)
        self._store = None
        shutil.rmtree(self._store_dir, ignore_errors=True)
        log.info("tensor-parallel workers stopped")
