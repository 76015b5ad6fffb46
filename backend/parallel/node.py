"""Tensor-parallel ranks on other hosts: how they join rank 0, and the node launcher.

Rank 0 (group.py) hosts the rendezvous TCP store on MASTER_ADDR:MASTER_PORT and, while a group
starts, accepts the step channels of remote ranks on MASTER_PORT+1 (RankListener). On each
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
import secrets
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import (AuthenticationError, Client, Connection,
                                        answer_challenge, deliver_challenge, wait)
from pathlib import Path

from backend.parallel.group import STARTUP_TIMEOUT_S, WorkerSpec, python_executable

log = logging.getLogger("backend.parallel")

AUTHKEY_ENV = "TPLLM_TP_AUTHKEY"
AUTHKEY_FILE_ENV = "TPLLM_TP_AUTHKEY_FILE"
FATAL_EXIT = 2
REJOIN_TIMEOUT_S = 60.0  # a restarted rank waits this long for rank 0's rebuilt group
HANDSHAKE_S = 10  # a connection that does not finish the handshake by then is dropped
KEEPALIVE = (10, 5, 3)  # idle s, probe interval s, probes: a vanished host's channel ends in ~25 s
JOIN_RETRY_S = 0.5


# ---- the shared key ------------------------------------------------------------------------
def authkey_path(path: str | None = None) -> Path:
    if path or os.environ.get(AUTHKEY_FILE_ENV):
        return Path(path or os.environ[AUTHKEY_FILE_ENV]).expanduser()
    from backend.model.gguf_import import cache_root
    return cache_root() / "tp-authkey"


def resolve_authkey(create: bool, path: str | None = None) -> bytes:
    """The group's shared secret: $TPLLM_TP_AUTHKEY, else the key file (`path`, else
    $TPLLM_TP_AUTHKEY_FILE, else <cache dir>/tp-authkey). Rank 0 (`create`) writes a random key
    there (mode 0600) when there is none; the other hosts need a copy."""
    key = os.environ.get(AUTHKEY_ENV, "").strip()
    if not key:
        p = authkey_path(path)
        if create and not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass  # another rank 0 wrote it meanwhile
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_hex(32) + "\n")
                log.warning("wrote a new tensor-parallel authkey to %s: copy it to the other "
                            "hosts (or set %s on every host)", p, AUTHKEY_ENV)
        try:
            key = p.read_text().strip()
        except FileNotFoundError:
            raise RuntimeError(f"no tensor-parallel authkey: set {AUTHKEY_ENV}, or copy rank 0's "
                               f"key file to {p}") from None
    if len(key) < 16:
        raise ValueError(f"{AUTHKEY_ENV}: the authkey needs at least 16 characters")
    return key.encode()


# ---- the step channel ----------------------------------------------------------------------
def _tune(conn: Connection, recv_timeout_s: int = 0) -> None:
    """TCP keepalive (a host that vanishes without closing its sockets still ends the channel)
    and a receive timeout (0: none) on a channel's socket."""
    sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)  # a dup, same socket
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in zip((socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT),
                              KEEPALIVE):
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", recv_timeout_s, 0))
    finally:
        sock.close()


class RankListener:
    """Rank 0's end: accepts remote ranks' step channels on (addr, port) while a group starts."""

    def __init__(self, addr: str, port: int, authkey: bytes):
        try:
            self._sock = socket.create_server((addr, port))
        except OSError as e:
            raise RuntimeError(f"tp_master_port: cannot listen on {addr}:{port} for the remote "
                               f"ranks' step channels ({e})") from None
        self._authkey = authkey

    def accept(self, timeout: float) -> tuple[int, Connection] | None:
        """An authenticated remote rank and the rank number it asked for; None when nobody came
        within `timeout` or a connection failed the handshake (logged and dropped)."""
        if not select.select([self._sock], [], [], timeout)[0]:
            return None
        try:
            sock, peer = self._sock.accept()
        except OSError as e:  # e.g. the client gave up meanwhile
            log.warning("tensor-parallel step listener: %s", e)
            return None
        conn = Connection(sock.detach())
        try:
            _tune(conn, HANDSHAKE_S)  # a silent peer must not stall the start
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
            kind, rank = conn.recv()
            if kind != "join" or not isinstance(rank, int):
                raise ValueError(f"unexpected first message {kind!r}")
            _tune(conn)
        except (AuthenticationError, EOFError, OSError, ValueError, TypeError) as e:
            log.warning("dropped a tensor-parallel connection from %s:%s: %s", *peer[:2], e)
            conn.close()
            return None
        return rank, conn

    def close(self) -> None:
        self._sock.close()


def join(addr: str, port: int, authkey: bytes, rank: int,
         timeout: float) -> tuple[Connection, WorkerSpec]:
    """A remote rank's end: connect to rank 0's listener as `rank` (retrying while rank 0 is not
    listening yet) and receive the rank's spec."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = Client((addr, port), family="AF_INET", authkey=authkey)
            _tune(conn, HANDSHAKE_S)
            conn.send(("join", rank))
            kind, body = conn.recv()
            _tune(conn)
            break
        except (OSError, EOFError) as e:  # not listening yet, or between two groups
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 not reachable at {addr}:{port} in {timeout:.0f}s "
                                   f"({e})") from None
            time.sleep(JOIN_RETRY_S)
    if kind != "spec":
        conn.close()
        raise RuntimeError(f"rank 0 refused rank {rank}: {body}")
    return conn, body


def route_address(host: str, port: int) -> str:
    """This host's address on the route to `host`: the one gloo binds to, so rank 0 reaches it
    (a hostname may resolve to an address of another interface, or to none at all)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


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
    from backend.parallel.worker import worker_main
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
