"""The server listens where Triton is configured to and nowhere else; its processes write files only
under the working directory, the cache directory, temporary directories and the model
repository. Listening sockets are read from /proc (socket inodes of every process of the tree ->
/proc/net/tcp{,6} LISTEN entries); writes are traced with strace (every open for writing,
mkdir, rename, unlink, ... of the whole tree, from launch to exit) plus the files the tree holds
open at the end. Without strace the write check skips, saying so: the open files alone miss
every file written and closed before (CI checks that strace is installed: .ci/run)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from client.generate import ServerError, generate
from client.server import ROOT
from tests.integration import proctree
from tests.integration.conftest import BASE_PARAMS, NO_WARMUP, Server, make_repo
from tpllm_kernels.cache_dir import cache_root

pytestmark = pytest.mark.integration
TRACED = ("open,openat,openat2,creat,mkdir,mkdirat,rename,renameat,renameat2,link,linkat,symlink,"
          "symlinkat,unlink,unlinkat,rmdir,truncate,chmod,fchmodat,utimensat")
_LINE = re.compile(r"^(\d+)\s+(\w+)\((.*)\)\s+=\s+(-?\d+)(?:<(.*)>)?")
_WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND")


def _has_gpus() -> bool:
    p = Path("/proc/driver/nvidia/gpus")
    return p.is_dir() and any(p.iterdir())


def written_paths(trace_text: str, default_cwd: str) -> set[str]:
    """Absolute paths that the traced processes created, opened for writing, renamed, removed or
    changed (successful calls only) in an `strace -f -y` log."""
    pending: dict[str, str] = {}
    cwd: dict[str, str] = {}
    out = set()
    for raw in trace_text.splitlines():
        pid, _, rest = raw.partition(" ")
        rest = rest.strip()
        if rest.endswith("<unfinished ...>"):
            pending[pid] = rest[:-len("<unfinished ...>")].rstrip()
            continue
        m = re.match(r"<\.\.\. \w+ resumed>(.*)", rest)
        if m:
            rest = pending.pop(pid, "") + m.group(1)
        m = _LINE.match(f"{pid} {rest}")
        if not m:
            continue
        _, call, args, ret, ret_path = m.groups()
        here = re.search(r"AT_FDCWD<([^>]*)>", args)
        if here:
            cwd[pid] = here.group(1)
        if int(ret) < 0:
            continue
        if call in ("open", "openat", "openat2"):
            if not any(f in args for f in _WRITE_FLAGS):
                continue
            if ret_path:
                out.add(ret_path)
                continue
        # every quoted path argument, resolved against its dirfd (strace -y prints fd<path>)
        for dirfd, path in re.findall(r'(?:(?:AT_FDCWD|\d+)<([^>]*)>,\s*)?"((?:[^"\\]|\\.)*)"',
                                      args):
            base = dirfd or cwd.get(pid, default_cwd)
            out.add(os.path.normpath(os.path.join(base, path)))
    return out


def test_written_paths_parser():
    """The checker itself finds writes (so the test below can fail)."""
    trace = "\n".join([
        '10 openat(AT_FDCWD</w>, "/etc/evil", O_WRONLY|O_CREAT|O_TRUNC, 0644) = 3</etc/evil>',
        '10 openat(AT_FDCWD</w>, "/etc/passwd", O_RDONLY|O_CLOEXEC) = 4</etc/passwd>',
        '11 openat(AT_FDCWD</w>, "rel/out.txt", O_RDWR|O_CREAT <unfinished ...>',
        '12 mkdir("/home/u/.config/x", 0777) = 0',
        '11 <... openat resumed>, 0666) = 5</w/rel/out.txt>',
        '12 unlink("gone") = -1 ENOENT (No such file or directory)',
        '12 rename("a", "/var/b") = 0',
    ])
    assert written_paths(trace, "/cwd") == {"/etc/evil", "/w/rel/out.txt", "/home/u/.config/x",
                                            "/cwd/a", "/var/b"}


def test_listens_only_on_the_configured_ports(server):
    pids = proctree.tree(server.proc.pid)
    socks = proctree.listening(pids)
    ports = {port for entries in socks.values() for _, port, _ in entries}
    assert ports == {server.http_port, server.grpc_port, server.metrics_port}, \
        {proctree.role(p): s for p, s in socks.items()}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """A TP-2 server (worker process, resource tracker, shared memory: every kind of process we
    start) with HOME, XDG_CACHE_HOME and TMPDIR in a sandbox, run under strace when available."""
    d = tmp_path_factory.mktemp("ports_writes")
    home, tmp = d / "home", d / "tmp"
    (home / ".cache").mkdir(parents=True)
    tmp.mkdir()
    cache = cache_root()  # the real one: the model and the compiled kernels are there already
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
           "TPLLM_CACHE_DIR": str(cache), "TMPDIR": str(tmp)}
    repo = make_repo(d / "repo", {**BASE_PARAMS, **NO_WARMUP, "tensor_parallel_size": "2",
                                  "num_threads": "1"})
    trace = d / "strace.log"
    wrap = ["strace", "-f", "-qq", "-y", "--seccomp-bpf", "-e", "signal=none",
            "-e", f"trace={TRACED}", "-o", str(trace)] if shutil.which("strace") else []
    srv = Server(repo, d / "server.log", env=env, wrap=wrap)
    try:
        srv.wait_ready()
        yield srv, {"home": home, "tmp": tmp, "cache": cache, "repo": repo,
                    "trace": trace if wrap else None, "dir": d}
    finally:
        srv.stop()


def test_tp_group_listens_on_no_port(tp2):
    srv, _ = tp2
    pids = proctree.tree(srv.proc.pid)
    socks = proctree.listening(pids)
    extra = {(proctree.role(p), host, port) for p, entries in socks.items()
             for host, port, _ in entries
             if port not in (srv.http_port, srv.grpc_port, srv.metrics_port)}
    assert not extra, extra


def test_writes_only_to_working_cache_and_temp_dirs(tp2):
    srv, where = tp2
    if where["trace"] is None:
        pytest.skip("strace is not installed: without it this check would see only the files "
                    "open at the end, not every write (apt-get install strace)")
    generate({"text_input": "Hello", "max_tokens": 4, "temperature": 0.0, "stream": True},
             "grpc", srv.grpc_url)
    generate({"text_input": "Hello", "max_tokens": 4}, "http", srv.http_url)
    with pytest.raises(ServerError):
        generate({"text_input": "", "max_tokens": 4}, "http", srv.http_url)
    pids = proctree.tree(srv.proc.pid)
    ids = proctree.identities(pids)
    sampled = proctree.writable_files(pids)
    launcher = next(p for p in pids if proctree.role(p) == "launcher")
    os.kill(launcher, signal.SIGINT)  # strace itself holds fatal signals: stop the launcher
    srv.proc.wait(90)
    assert proctree.left_after(ids) == []
    allowed = [str(ROOT), str(where["dir"]), str(where["cache"]), str(where["home"] / ".cache"),
               str(where["tmp"]), tempfile.gettempdir(), "/tmp", "/dev/shm", "/dev/null",
               "/dev/pts", "/proc/self", "/dev/tty"]
    if _has_gpus():  # Triton's GPU metrics (DCGM) log here; the launcher leaves them on with GPUs
        allowed.append("/var/log/nv-hostengine.log")
    written = set(sampled) | written_paths(where["trace"].read_text(errors="replace"), str(ROOT))
    assert any("/dev/shm/tpllm_" in p for p in written), "the trace saw no TP shared memory"
    outside = sorted(p for p in written
                     if not any(p == a or p.startswith(a.rstrip("/") + "/") for a in allowed)
                     and not re.match(r"/proc/\d+/", p))
    assert outside == [], outside
    home_files = [str(p) for p in where["home"].rglob("*")
                  if not str(p).startswith(str(where["home"] / ".cache"))]
    assert home_files == [], home_files
    # what the tree created in temp dirs and /dev/shm is gone after a clean exit (the checkout
    # itself may live under /tmp, as in CI: its bytecode caches are working-dir files)
    temp_roots = ("/dev/shm/", "/tmp/", str(where["tmp"]) + "/")
    # (nor what it keeps in the cache dir, which may be under /tmp too: the kernels' build lock)
    keep = (str(where["dir"]), str(ROOT) + "/", str(where["cache"]).rstrip("/") + "/")
    left = sorted(p for p in written if p.startswith(temp_roots) and os.path.exists(p)
                  and not p.startswith(keep) and p != "/tmp")
    assert left == [], left
