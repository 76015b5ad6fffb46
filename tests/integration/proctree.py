"""What a running server owns, read from /proc: its process tree, listening sockets, shared-memory
segments and files open for writing. Linux only (the integration tests need it anyway)."""
from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

from backend.serve import child_pids


children = child_pids  # direct children, from /proc


def tree(root: int) -> list[int]:
    """root and all its descendants (alive now)."""
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in seen or not Path(f"/proc/{pid}").exists():
            continue
        seen.append(pid)
        todo += children(pid)
    return seen


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace").strip()
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """The kernel's start time of pid (with the pid, an identity that survives pid reuse)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def identities(pids) -> set[tuple[int, int]]:
    return {(p, t) for p in pids if (t := start_time(p)) is not None}


def still_alive(ids: set[tuple[int, int]]) -> list[tuple[int, str, str]]:
    """The processes of `ids` that still exist (zombies included): (pid, state, cmdline)."""
    return [(p, state(p), cmdline(p)) for p, t in ids if start_time(p) == t]


def left_after(ids: set[tuple[int, int]], timeout: float = 30.0) -> list[tuple[int, str, str]]:
    """still_alive(ids), polled until it is empty or `timeout` s have passed: a process that
    exited is reaped by its parent a moment later, later still on a slow or loaded host."""
    deadline = time.monotonic() + timeout
    while (left := still_alive(ids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def role(pid: int) -> str:
    """A process's role in the serving tree, independent of its pid."""
    c = cmdline(pid)
    argv0 = c.split(" ", 1)[0].rsplit("/", 1)[-1]
    if argv0 == "strace":
        return "strace"
    if "triton_python_backend_stub" in c:
        return "stub"
    if "resource_tracker" in c:
        return "resource_tracker"
    if "multiprocessing.spawn" in c or "spawn_main" in c:
        return "tp_worker"
    if "backend.serve" in c:
        return "launcher"
    if argv0 == "tritonserver":
        return "tritonserver"
    return c[:80]


def tp_workers(root: int) -> list[int]:
    return [p for p in tree(root) if role(p) == "tp_worker"]


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(fd.path)
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    except OSError:
        pass
    return out


def _addr(hexaddr: str) -> tuple[str, int]:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        host = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # /proc/net/tcp6: four little-endian 32-bit words
        host = socket.inet_ntop(socket.AF_INET6, b"".join(
            struct.pack(">I", struct.unpack("<I", raw[i:i + 4])[0]) for i in range(0, 16, 4)))
    return host, int(port, 16)


def listening(pids) -> dict[int, list[tuple[str, int, int]]]:
    """{pid: [(host, port, inode)]} of the TCP sockets in LISTEN state that `pids` hold."""
    table = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":  # TCP_LISTEN
                table[int(f[9])] = _addr(f[1])
    out = {}
    for pid in pids:
        socks = [(*table[i], i) for i in _socket_inodes(pid) if i in table]
        if socks:
            out[pid] = socks
    return out


def shm_segments(pids) -> set[str]:
    """/dev/shm files that `pids` map or hold open."""
    out = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if len(line.split()) >= 6 else ""
                if path.startswith("/dev/shm/"):
                    out.add(path.removesuffix(" (deleted)"))
        except OSError:
            pass
        for word in cmdline(pid).split():
            if word.startswith("triton_python_backend_shm_region"):
                out.add(f"/dev/shm/{word}")
        for f in writable_files([pid]):
            if f.startswith("/dev/shm/"):
                out.add(f)
    return out


def writable_files(pids) -> set[str]:
    """Paths of regular files that `pids` hold open for writing (O_WRONLY / O_RDWR)."""
    out = set()
    for pid in pids:
        try:
            fds = list(os.scandir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd.path)
                flags = int(Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text().split("flags:")[1]
                            .split()[0], 8)
            except (OSError, IndexError, ValueError):
                continue
            if target.startswith("/") and flags & 0o3 in (os.O_WRONLY, os.O_RDWR):
                out.add(target.removesuffix(" (deleted)"))
    return out
