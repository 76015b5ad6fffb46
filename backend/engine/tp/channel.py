"""How a tensor-parallel rank on another host reaches rank 0: the shared authkey, rank 0's
listener for remote ranks' step channels (RankListener, used by group.py while a group starts)
and a remote rank's end of it (join, used by node.py's launcher). See node.py for the protocol.
"""
from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import struct
import time
from multiprocessing.connection import (AuthenticationError, Client, Connection,
                                        answer_challenge, deliver_challenge)
from pathlib import Path

from backend.parallel.spec import WorkerSpec

log = logging.getLogger("backend.parallel")

AUTHKEY_ENV = "TPLLM_TP_AUTHKEY"
AUTHKEY_FILE_ENV = "TPLLM_TP_AUTHKEY_FILE"
HANDSHAKE_S = 10  # a connection that does not finish the handshake by then is dropped
KEEPALIVE = (10, 5, 3)  # idle s, probe interval s, probes: a vanished host's channel ends in ~25 s
JOIN_RETRY_S = 0.5


# ---- the shared key ------------------------------------------------------------------------
def authkey_path(path: str | None = None) -> Path:
    if path or os.environ.get(AUTHKEY_FILE_ENV):
        return Path(path or os.environ[AUTHKEY_FILE_ENV]).expanduser()
    from tpllm_kernels.cache_dir import cache_root
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


def peer_host(conn: Connection) -> str:
    """The address a step channel's other end connects from (what names a lost remote rank)."""
    sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)  # a dup, same socket
    try:
        return sock.getpeername()[0]
    except OSError:
        return "unknown"
    finally:
        sock.close()


def route_address(host: str, port: int) -> str:
    """This host's address on the route to `host`: the one gloo binds to, so rank 0 reaches it
    (a hostname may resolve to an address of another interface, or to none at all)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]
