"""A tensor-parallel worker process (ranks 1..N-1): load this rank's shards, then run every step
rank 0 sends until told to stop or rank 0 disappears. `conn` is a pipe to rank 0, or, for a rank
on another host, a TCP connection (node.py) with the same API."""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys
import time
from pathlib import Path

import torch

from backend.engine.config import DTYPES
from backend.engine.model_runner import ModelRunner
from backend.model.config import ModelConfig
from backend.model.loader import load_model
from backend.model.lora_adapter import load_adapters
from backend.model.lora_layers import attach_adapters
from backend.parallel.comm_select import connect, rank_device, rendezvous_store
from backend.parallel.context import ParallelContext
from backend.parallel.spec import REJOIN, REJOIN_EXIT, STARTED, STARTUP_TIMEOUT_S, WorkerSpec
from backend.parallel.shm_comm import PeerLostError, ranks_outnumber_cores
from backend.process_exit import exit_now

log = logging.getLogger("backend.parallel")
NEXT_STEP_SPIN_S = 0.005  # covers rank 0's between-step work (sampling, scheduling)


def _build_rank(spec: WorkerSpec, parent_pid: int) -> ModelRunner:
    if spec.cpu is not None:
        os.sched_setaffinity(0, {spec.cpu})
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    dtype = DTYPES[spec.dtype]
    device = rank_device(spec.device, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=STARTUP_TIMEOUT_S)
    store = rendezvous_store(spec, timeout)
    comm = connect(spec, store, dtype, timeout, peers_alive=lambda: os.getppid() == parent_pid)
    ctx = ParallelContext(spec.rank, spec.world, comm)
    model_dir = Path(spec.model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, cfg, ctx, dtype, device)
    model.lora_rows = attach_adapters(model, load_adapters(spec.lora_modules or {}, cfg,
                                                           spec.max_lora_rank))
    runner = ModelRunner(model, spec.num_blocks, spec.block_size, spec.max_model_len, dtype,
                         device, spec.packed_rows)
    if spec.greedy_screening:  # as rank 0's (a rank whose kernels cannot has none: see below)
        model.lm_head.enable_greedy_screening()
    if spec.cuda_graphs:  # captured at the same warmup steps as rank 0's
        runner.enable_decode_graphs(spec.decode_sizes, use_graphs=True)
    runner.keepalive = (store, comm)  # the store client must live as long as the group
    return runner


def _next_message(conn, spin_s: float) -> bytes:
    """The next step message. Polls for up to spin_s first: woken from recv, a rank reaches a
    decode step's first collective well after rank 0, which waits there for it (`python -m client
    bench tp`). Not when ranks outnumber cores: the poller would hold a core a peer needs."""
    if spin_s:
        deadline = time.perf_counter() + spin_s
        while not conn.poll() and time.perf_counter() < deadline:
            pass
    return conn.recv_bytes()


def worker_main(spec: WorkerSpec, conn, parent_pid: int) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[rank {spec.rank}] %(message)s")
    conn.send((STARTED, None))
    try:
        runner = _build_rank(spec, parent_pid)
    except BaseException as e:  # report, don't hang rank 0
        conn.send(("error", f"{type(e).__name__}: {e}"))
        exit_now(0)  # as a finished rank: a node launcher must not restart it
    # what rank 0 must know of this rank: whether it screens greedy steps (greedy_head.py; rank
    # 0 asks for screened steps only if every rank does)
    conn.send(("ready", {"greedy_screening": runner.model.lm_head.screen is not None}))
    spin_s = 0.0 if ranks_outnumber_cores(spec.world) else NEXT_STEP_SPIN_S
    while True:
        try:
            payload = _next_message(conn, spin_s)
        except (EOFError, OSError):
            break  # rank 0 is gone
        step = pickle.loads(payload)
        if step is None:
            break
        if isinstance(step, str) and step == REJOIN:  # remote rank: its launcher restarts it
            sys.exit(REJOIN_EXIT)
        try:
            runner.forward(step)
        except PeerLostError as e:
            log.error("%s", e)
            break
        except Exception:
            log.exception("step failed; this worker exits and rank 0 fails the step")
            exit_now(1)
    # Rank 0 joins this process (on a server shutdown, inside tritonserver's exit timeout):
    # leave without the interpreter's seconds-long teardown (backend/process_exit.py).
    exit_now(0)
