"""A tensor-parallel group: rank 0 lives in this process, ranks 1..N-1 are worker processes it
starts and owns (or, multi-host, ranks that join from other hosts: see the end).

Start-up: rank 0 creates the rendezvous store (a torch FileStore in a private temp directory: no
port is opened) and the shared-memory segment, then spawns the workers (same Python, `spawn`
start method). The gloo fallback group for messages too large for shared memory is formed
through the store only if such a message ever comes (comm_select.LazyGloo). Every rank loads
only its own weight shards and allocates its own KV cache. Each step, rank 0 sends the step's inputs to every
worker as one pickled message over a pipe; all ranks then run the same forward pass, meeting in
the collectives. Workers exit when rank 0 says so, when their pipe closes (rank 0 died), or when
a collective notices rank 0 is gone; close() kills any straggler, so none outlives the engine.

Multi-host (`local_ranks` < N): the store is a TCP store rank 0 hosts on spec.master_addr:
master_port, every collective goes through gloo (shared memory is one-host), the local workers
start as above, and ranks local_ranks..N-1 connect from their hosts' node launchers (node.py)
to port+1 with the shared authkey; each gets its spec over that connection, which is then its
step channel, with the same Connection API as a pipe.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import replace

from multiprocessing.connection import Connection

import torch

from backend.engine.tp.channel import RankListener, peer_host, resolve_authkey
from backend.parallel.comm_select import connect, local_segment, rendezvous_store
from backend.parallel.context import ParallelContext
from backend.parallel.shm_comm import PeerLostError
from backend.parallel.spec import (REJOIN, STARTED, STARTUP_TIMEOUT_S, WorkerSpec,
                                   python_executable)

log = logging.getLogger("backend.parallel")


class TPGroup:
    def __init__(self, spec: WorkerSpec, dtype: torch.dtype, local_ranks: int | None = None):
        """Start the group described by rank 0's `spec` (workers load their shards meanwhile);
        ranks `local_ranks`.. (rank 0 is local) join from other hosts."""
        self.spec, self.dtype = spec, dtype
        self.world = spec.world
        self.screening_everywhere = False  # set by wait_ready
        self.local_ranks = local_ranks or spec.world
        self._authkey = b""
        if self.local_ranks < self.world:
            self._authkey = resolve_authkey(create=True)
        self.ctx = ParallelContext(0, spec.world, None)  # the model keeps this object for good
        self.closed = True
        self._start()

    def _start(self) -> None:
        self._procs: list[mp.process.BaseProcess] = []
        self._conns = []
        self._remote: dict[int, Connection] = {}  # rank -> step channel, multi-host
        self.remote_hosts: dict[int, str] = {}  # rank -> the address it joined from
        self._listener = None
        self._store_dir = tempfile.mkdtemp(prefix="tpllm-tp-")
        self.comm = None
        self.closed = False
        # Set by the engine when a step failed with this group (a rank died or a collective
        # timed out): the group is unusable, whatever its processes and channels show yet.
        self.step_failed = False
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
        base = replace(self.spec, store_path=os.path.join(self._store_dir, "store"),
                       shm_name=self.comm.name if self.comm else "")
        self._store = rendezvous_store(base, timeout)
        ctx = mp.get_context("spawn")
        ctx.set_executable(python_executable())
        from backend.engine.tp.worker import worker_main  # here: it pulls in the model and engine
        for rank in range(1, self.local_ranks):
            parent, child = ctx.Pipe()
            spec = replace(base, rank=rank,
                           cpu=None if self.spec.cpu is None else rank % os.cpu_count())
            proc = ctx.Process(target=worker_main, args=(spec, child, os.getpid()),
                               name=f"tpllm-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        if self.local_ranks < self.world:
            self._accept_remote(base)
        self.comm = self.ctx.comm = connect(base, self._store, self.dtype, timeout,
                                            self.workers_alive, self.comm)

    def _accept_remote(self, base: WorkerSpec) -> None:
        """Wait until ranks local_ranks..N-1 have joined from their hosts; send each its spec.
        The step port is open only meanwhile."""
        addr, port = base.master_addr, base.master_port
        self._listener = RankListener(addr, port + 1, self._authkey)
        waiting = set(range(self.local_ranks, self.world))
        log.info("waiting for tensor-parallel ranks %s to join at %s:%d", sorted(waiting), addr,
                 port + 1)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while waiting:
            for rank, p in enumerate(self._procs, start=1):  # don't wait on a broken start
                if not p.is_alive():
                    raise self._startup_failure(rank)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"tensor-parallel ranks {sorted(waiting)} did not join in "
                    f"{STARTUP_TIMEOUT_S:.0f}s: start `python -m backend.parallel.node "
                    f"--master-addr {addr} --master-port {port} --ranks ...` on their hosts")
            joined = self._listener.accept(1.0)
            if joined is None:
                continue
            rank, conn = joined
            try:
                if rank not in waiting:
                    conn.send(("error", f"rank {rank} is not awaited (waiting for "
                                        f"{sorted(waiting)} of {self.world})"))
                    conn.close()
                    continue
                conn.send(("spec", replace(base, rank=rank)))
            except OSError as e:
                log.warning("tensor-parallel rank %d hung up while joining (%s)", rank, e)
                conn.close()
                continue
            self._remote[rank] = conn
            self.remote_hosts[rank] = peer_host(conn)
            waiting.discard(rank)
            log.info("tensor-parallel rank %d joined", rank)
        self._listener.close()
        self._listener = None

    def _all_conns(self) -> list[Connection]:
        """Every worker's step channel, in rank order (local ranks come first)."""
        return self._conns + [self._remote[r] for r in sorted(self._remote)]

    def restart(self) -> None:
        """Replace the workers (after one died): rank 0's model keeps its context object, which
        gets the new communicator; the workers reload their shards."""
        self.close(rejoin=True)
        self._start()
        self.wait_ready()

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        # every worker screens greedy steps (greedy_head.py), as they said when ready
        self.screening_everywhere = True
        for rank, conn in enumerate(self._all_conns(), start=1):
            detail = (self._wait_remote_ready(rank, conn, deadline) if rank >= self.local_ranks
                      else self._wait_local_ready(rank, conn, deadline, timeout))
            self.screening_everywhere &= bool((detail or {}).get("greedy_screening"))

    def _wait_local_ready(self, rank: int, conn: Connection, deadline: float,
                          timeout: float) -> dict | None:
        """What local rank `rank` sent with its ready report; raises if it died, failed or
        timed out first."""
        status, started = STARTED, False
        while status == STARTED:
            while not conn.poll(0.1):
                if not self._procs[rank - 1].is_alive():
                    raise self._startup_failure(rank, started)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel rank {rank} not ready in "
                                       f"{timeout:.0f}s")
            try:
                status, detail = conn.recv()
            except (EOFError, OSError):  # it died before reporting (e.g. a failed spawn)
                raise self._startup_failure(rank, started) from None
            started = True
        if status != "ready":
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {detail}")
        return detail

    def _startup_failure(self, rank: int, started: bool = False) -> RuntimeError:
        """Why local rank `rank`, found dead during start-up, is gone: its own error report if
        it sent one, else its exit code, and if it never said it started, the likely cause."""
        proc, conn = self._procs[rank - 1], self._conns[rank - 1]
        proc.join(1.0)
        try:
            while conn.poll(0):  # what it sent before dying
                status, detail = conn.recv()
                if status == "error":
                    return RuntimeError(f"tensor-parallel rank {rank} failed to start: {detail}")
                started = True
        except (EOFError, OSError):
            pass
        msg = f"tensor-parallel rank {rank} exited during start-up (exit code {proc.exitcode})"
        if started:
            return RuntimeError(f"{msg}; its stderr says why")
        return RuntimeError(f"{msg} before running any worker code: {_bootstrap_hint()}")

    @staticmethod
    def _wait_remote_ready(rank: int, conn: Connection, deadline: float) -> dict | None:
        status = STARTED
        while status == STARTED:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"tensor-parallel rank {rank} (remote) not ready in time")
            try:
                status, detail = conn.recv()
            except (EOFError, OSError):
                raise RuntimeError(f"tensor-parallel rank {rank} (remote) hung up during "
                                   "start-up; its node launcher's log says why") from None
        if status != "ready":
            raise RuntimeError(f"tensor-parallel rank {rank} (remote) failed to start: {detail}")
        return detail

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def workers_alive(self) -> bool:
        return (all(p.is_alive() for p in self._procs)
                and all(_channel_open(c) for c in self._remote.values()))

    def lost_ranks(self) -> dict[int, str]:
        """rank -> host of the ranks found gone now (engine/lost_rank.py names them)."""
        here = socket.gethostname()
        lost = {r: here for r, p in enumerate(self._procs, start=1) if not p.is_alive()}
        lost.update((r, self.remote_hosts.get(r, "unknown")) for r, c in self._remote.items()
                    if not _channel_open(c))
        return lost

    def broadcast(self, step) -> None:
        """Send one step to every worker: one pickled message each."""
        payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._all_conns():
                conn.send_bytes(payload)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise PeerLostError(f"a tensor-parallel worker is gone ({e})") from None

    def close(self, timeout: float = 5.0, rejoin: bool = False) -> None:
        """Stop the workers; with `rejoin` (a rebuild follows), remote ranks are told to join the
        next group (their launcher starts them again) rather than to finish."""
        if self.closed:
            return
        self.closed = True
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        for conn in self._remote.values():
            try:
                conn.send_bytes(pickle.dumps(REJOIN if rejoin else None))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for conn in self._all_conns():
            conn.close()
        if self._listener is not None:
            self._listener.close()
        if self.comm is not None:
            self.comm.close(unlink=True)
        self._store = None
        shutil.rmtree(self._store_dir, ignore_errors=True)
        log.info("tensor-parallel workers stopped")


def _bootstrap_hint() -> str:
    """The likely cause of a worker that died before its own code ran. A spawned process first
    re-imports the parent's main module (the script), top level included: a script that starts
    an engine with tensor_parallel_size > 1 outside `if __name__ == "__main__":` makes each
    worker try to start one too, which multiprocessing refuses while bootstrapping."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None:  # an interactive session or an embedded interpreter: nothing re-imported
        return "its stderr says why"
    return (f"every worker first re-imports the main script ({path}): if it creates the LLM "
            f"with tensor_parallel_size > 1 at top level, move that under "
            f"`if __name__ == \"__main__\":` (see README, Tensor parallelism); else its stderr "
            f"says why")


def _channel_open(conn: Connection) -> bool:
    """A remote rank's channel is silent after "ready": readable means closed or reset (the rank
    died, or its host vanished: TCP keepalive)."""
    try:
        return not conn.poll(0)
    except OSError:
        return False
