"""Tensor-parallel ranks on other hosts: the node launcher (how they join rank 0: channel.py).

Rank 0 (group.py) hosts the rendezvous TCP store on MASTER_ADDR:MASTER_PORT and, while a group
starts, accepts the step channels of remote ranks on MASTER_PORT+1 (channel.RankListener). On each
other host

    python -m backend.parallel.node --master-addr A [--master-port P] --ranks 2,3

starts one process per listed rank. Each connects to rank 0 (multiprocessing.connection over
TCP, authenticated both ways with a shared key, so neither side unpickles a stranger's bytes),
says which rank it is, gets its WorkerSpec back and runs the ordinary worker loop (worker.py) on
that connection. The store and gloo's own sockets are not authenticated: a trusted network only.

A rank's exit code tells the launcher what to do: 0 (rank 0 closed the group, or is gone): done;
FATAL_EXIT (it could not join: wrong key, refused, timed out): given up; anything else (a crash,
a kill, REJOIN_EXIT: rank 0 is rebuilding the group after losing a worker): started again, to
join the rebuilt group. The launcher exits once none of its ranks is left; its ranks die with it.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
from dataclasses import dataclass, replace
from multiprocessing.connection import wait

from backend.engine.tp.channel import (AUTHKEY_ENV, AUTHKEY_FILE_ENV, join, resolve_authkey,
                                      route_address)
from backend.parallel.spec import STARTUP_TIMEOUT_S, python_executable

log = logging.getLogger("backend.parallel")

FATAL_EXIT = 2
REJOIN_TIMEOUT_S = 60.0  # a restarted rank waits this long for rank 0's rebuilt group


# ---- the launcher --------------------------------------------------------------------------
@dataclass
class NodeOptions:
    master_addr: str
    master_port: int
    authkey: bytes
    ranks: tuple[int, ...]
    model_dir: str | None  # None: rank 0's path
    num_threads: int
    launcher_pid: int


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the launcher dies, however it dies (Linux prctl)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(0)


def remote_rank_main(opts: NodeOptions, rank: int, join_timeout: float) -> None:
    """One remote rank (a child of the launcher): join rank 0, then the ordinary worker loop."""
    _die_with_parent(opts.launcher_pid)
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(message)s")
    from backend.engine.tp.worker import worker_main  # here: the launcher itself needs no torch
    try:
        conn, spec = join(opts.master_addr, opts.master_port + 1, opts.authkey, rank,
                          join_timeout)
        spec = replace(spec, model_dir=opts.model_dir or spec.model_dir,
                       num_threads=opts.num_threads,
                       cpu=None if spec.cpu is None else opts.ranks.index(rank) % os.cpu_count(),
                       gloo_host=route_address(opts.master_addr, opts.master_port))
    except Exception as e:  # not worth restarting: the launcher gives up on this rank
        log.error("cannot join the tensor-parallel group: %s", e)
        sys.exit(FATAL_EXIT)
    worker_main(spec, conn, opts.launcher_pid)


def parse_ranks(text: str) -> tuple[int, ...]:
    """'2,3' or '2-5' or a mix, e.g. '1,4-6'."""
    ranks: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        ranks.extend(range(int(lo), int(hi or lo) + 1))
    if not ranks or min(ranks) < 1 or len(set(ranks)) != len(ranks):
        raise ValueError(f"--ranks: distinct ranks >= 1 (rank 0 is the engine), got {text!r}")
    return tuple(ranks)


def run_node(opts: NodeOptions, join_timeout: float) -> int:
    """Run the node's ranks until none is left; 0 when all ended cleanly."""
    ctx = mp.get_context("spawn")
    ctx.set_executable(python_executable())
    procs: dict[int, mp.process.BaseProcess] = {}
    failed = False

    def start(rank: int, timeout: float) -> None:
        p = ctx.Process(target=remote_rank_main, args=(opts, rank, timeout),
                        name=f"tpllm-rank{rank}", daemon=True)
        p.start()
        procs[rank] = p
        log.info("rank %d started (pid %d)", rank, p.pid)

    try:
        for rank in opts.ranks:
            start(rank, join_timeout)
        while procs:
            wait([p.sentinel for p in procs.values()])
            for rank, p in list(procs.items()):
                if p.is_alive():
                    continue
                p.join()
                del procs[rank]
                if p.exitcode == 0:
                    log.info("rank %d finished", rank)
                elif p.exitcode == FATAL_EXIT:
                    failed = True
                    log.error("rank %d could not join rank 0; giving up on it", rank)
                else:  # rank 0 rebuilds the group after a lost worker: join the new one
                    log.warning("rank %d exited (code %s); starting it again to rejoin",
                                rank, p.exitcode)
                    start(rank, REJOIN_TIMEOUT_S)
    finally:
        for p in procs.values():
            p.kill()
            p.join(5.0)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.parallel.node",
                                 description="Start this host's tensor-parallel ranks.")
    ap.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"),
                    help="rank 0's address (default $MASTER_ADDR)")
    ap.add_argument("--master-port", type=int, default=os.environ.get("MASTER_PORT") or 29500,
                    help="rank 0's store port; step channels use port+1 (default $MASTER_PORT "
                         "or 29500)")
    ap.add_argument("--ranks", required=True, help="this host's global ranks, e.g. 2,3 or 2-3")
    ap.add_argument("--authkey-file", help=f"the shared key (default ${AUTHKEY_ENV}, else "
                                           f"${AUTHKEY_FILE_ENV}, else <cache dir>/tp-authkey)")
    ap.add_argument("--model-dir", help="the checkpoint on this host (default: rank 0's path)")
    ap.add_argument("--num-threads", type=int, help="torch threads per rank (default: this "
                                                    "host's cores / its ranks)")
    ap.add_argument("--join-timeout", type=float, default=STARTUP_TIMEOUT_S,
                    help="seconds to wait for rank 0 at first (default %(default)s)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[node] %(message)s")
    if not args.master_addr:
        ap.error("--master-addr (or $MASTER_ADDR) is required")
    try:
        ranks = parse_ranks(args.ranks)
        authkey = resolve_authkey(create=False, path=args.authkey_file)
    except (ValueError, RuntimeError) as e:
        ap.error(str(e))
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // len(ranks))
    opts = NodeOptions(args.master_addr, args.master_port, authkey, ranks, args.model_dir,
                       threads, os.getpid())
    # SIGTERM/SIGINT end the launcher through run_node's cleanup (its ranks die with it anyway)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return run_node(opts, args.join_timeout)


if __name__ == "__main__":
    sys.exit(main())
