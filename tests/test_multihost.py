"""Tensor parallelism across hosts: rank 0 and a local worker on one "host", the node launcher's
rank on another, against TP 1's tokens. Two ways to make the hosts: network namespaces joined by
a veth pair (root and iproute2 only), and two loopback addresses of one namespace (anyone: rank
0 serves on 127.0.0.2, the remote rank's sockets bind 127.0.0.1, its route to 127.0.0.2), which
runs the same cross-host code (TCP store, authenticated step channel, gloo for every
collective, the node launcher). Plus the pieces that need no hosts (config, authkey, channel)."""
from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import AuthenticationError
from pathlib import Path

import pytest

from backend import LLM, SamplingParams
from backend.engine.config import EngineConfig
from backend.engine.tp.channel import RankListener, join, resolve_authkey
from backend.engine.tp.node import parse_ranks
from tests.tiny_models import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
ADDR_A, ADDR_B, PORT = "10.213.0.1", "10.213.0.2", 29500
LOOPBACK_MASTER = "127.0.0.2"  # rank 0's host; the other "host" is 127.0.0.1 (its route there)
PROMPTS = [list(range(5 + i, 30 + 3 * i)) for i in range(3)]


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(**{"tensor_parallel_size": 2, "device": "cpu", **kw})


def test_multi_host_config(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    for kw, field in [({"tp_local_ranks": 3}, "tp_local_ranks"),
                      ({"tp_local_ranks": 0}, "tp_local_ranks"),
                      ({"tp_local_ranks": 1}, "tp_master_addr"),
                      ({"tp_local_ranks": 1, "tp_master_addr": "h", "tp_master_port": 65535},
                       "tp_master_port"),
                      ({"tp_local_ranks": 1, "tp_master_addr": "h", "tp_collective_timeout_s": 0},
                       "tp_collective_timeout_s"),
                      ({"tp_master_addr": "h"}, "tp_master_addr")]:  # all ranks local
        with pytest.raises(ValueError, match=f"^{field}:"):
            _cfg(**kw).validate()
    _cfg(tp_local_ranks=2).validate()  # every rank here: the single-host group
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    cfg = _cfg(tp_local_ranks=1)
    cfg.validate()
    assert cfg.tp_remote_ranks == 1 and cfg.resolved_master() == ("10.0.0.1", 29500)
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert cfg.resolved_master() == ("10.0.0.1", 1234)
    assert _cfg(tp_local_ranks=1, tp_master_addr="h", tp_master_port=7).resolved_master() == ("h", 7)
    monkeypatch.setenv("MASTER_PORT", "x")
    with pytest.raises(ValueError, match="^tp_master_port:"):
        cfg.validate()
    assert parse_ranks("1,3-4") == (1, 3, 4)
    for bad in ("0", "2,2", ""):
        with pytest.raises(ValueError):
            parse_ranks(bad)


def test_authkey_and_step_channel(tmp_path, monkeypatch):
    """Rank 0 writes the key file (0600) when there is none; a node without it fails; the step
    listener drops a client with the wrong key and hands over one with the right key."""
    monkeypatch.delenv("TPLLM_TP_AUTHKEY", raising=False)
    monkeypatch.setenv("TPLLM_TP_AUTHKEY_FILE", str(tmp_path / "key"))
    with pytest.raises(RuntimeError, match="TPLLM_TP_AUTHKEY"):
        resolve_authkey(create=False)
    key = resolve_authkey(create=True)
    assert len(key) == 64 and stat.S_IMODE((tmp_path / "key").stat().st_mode) == 0o600
    assert resolve_authkey(create=False) == key == resolve_authkey(create=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    listener = RankListener("127.0.0.1", port, key)
    results: dict[str, object] = {}

    def client(name: str, k: bytes) -> None:
        try:
            results[name] = join("127.0.0.1", port, k, 1, timeout=10)[1]
        except Exception as e:
            results[name] = e

    try:
        t = threading.Thread(target=client, args=("bad", b"w" * 32))
        t.start()
        assert listener.accept(10) is None
        t.join(10)
        assert isinstance(results["bad"], AuthenticationError)
        t = threading.Thread(target=client, args=("good", key))
        t.start()
        rank, conn = listener.accept(10)
        conn.send(("spec", "the spec"))
        t.join(10)
        assert rank == 1 and results["good"] == "the spec"
        conn.close()
    finally:
        listener.close()


# ---- two "hosts" --------------------------------------------------------------------------
RANK0 = r"""
import json, sys, time
from backend import LLM, SamplingParams


def main():  # spawned workers import this file: only rank 0 runs it
    model, addr, port, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(model=model, tensor_parallel_size=3, tp_local_ranks=2, tp_master_addr=addr,
              tp_master_port=port, tp_collective_timeout_s=10, num_threads=1, num_kv_blocks=64,
              block_size=8, warmup=False)
    gen = lambda: [o.token_ids for o in llm.generate(prompts, sp)]
    say = lambda **kw: print(json.dumps(kw), flush=True)
    say(phase="up", tokens=gen(), local=llm.engine.group.worker_pids)
    for line in sys.stdin:  # the test killed a rank; the group is rebuilt
        t0, error = time.monotonic(), None
        if line.strip() == "step":  # a step meets the dead rank and fails
            try:
                gen()
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        else:  # noticed between steps, as the async engine's loop does
            while not llm.engine.needs_recovery and time.monotonic() < t0 + 20:
                time.sleep(0.05)
        failed_s, dead = time.monotonic() - t0, llm.engine.needs_recovery
        llm.engine.abort_all("error", error)
        llm.engine.recover()
        say(phase="recovered", error=error, failed_s=failed_s, dead=dead, tokens=gen(),
            local=llm.engine.group.worker_pids)
    llm.close()
    say(phase="closed")


if __name__ == "__main__":
    main()
"""


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _remove_netns(names: list[str]) -> None:
    for ns in names:
        for pid in _ip("netns", "pids", ns).stdout.split():  # only what ran in our namespaces
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        _ip("netns", "del", ns)


def _free_port_pair(host: str) -> int:
    """A port p with p and p + 1 free on host (rank 0's store and step listener)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind((host, port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


@dataclass
class Hosts:
    """How to start a process on host A (rank 0) or B (the node), and rank 0's address."""
    prefix_a: list[str]
    prefix_b: list[str]
    master: str
    port: int


@pytest.fixture(params=["netns", "loopback"])
def two_hosts(request):
    if request.param == "loopback":
        yield Hosts([], [], LOOPBACK_MASTER, _free_port_pair(LOOPBACK_MASTER))
        return
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2 (the loopback variant of this "
                    "test covers the same cross-host code without them)")
    tag = os.getpid() % 100000
    a, b, va, vb = f"tpllm-a{tag}", f"tpllm-b{tag}", f"tpva{tag}", f"tpvb{tag}"
    steps = [("netns", "add", a), ("netns", "add", b),
             ("link", "add", va, "type", "veth", "peer", "name", vb),
             ("link", "set", va, "netns", a), ("link", "set", vb, "netns", b)]
    for ns, dev, addr in ((a, va, ADDR_A), (b, vb, ADDR_B)):
        steps += [("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                  ("-n", ns, "link", "set", dev, "up"), ("-n", ns, "link", "set", "lo", "up")]
    for step in steps:
        r = _ip(*step)
        if r.returncode:
            _ip("link", "del", va)
            _remove_netns([a, b])
            pytest.skip(f"cannot set up network namespaces: ip {' '.join(step)}: {r.stderr}")
    try:
        yield Hosts(["ip", "netns", "exec", a], ["ip", "netns", "exec", b], ADDR_A, PORT)
    finally:
        _remove_netns([a, b])
        assert not {a, b} & set(_ip("netns", "list").stdout.split())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _lines(stream) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [q.put(line) for line in stream], daemon=True).start()
    return q


@pytest.mark.slow
def test_tp_across_two_hosts(two_hosts, tmp_path):
    """TP 3 with ranks 0-1 on "host" A and rank 2 on "host" B (gloo over the veth pair, or
    between two loopback addresses): TP 1's tokens; a killed remote rank fails the step at once
    (not at a timeout) and the group is rebuilt with the rank restarted by its launcher; a killed
    local rank makes the remote one rejoin; after close nothing is left."""
    hosts = two_hosts
    model = make_tiny_checkpoint("qwen2", tmp_path / "model", num_heads=6, num_kv_heads=2)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(model=str(model), num_kv_blocks=64, block_size=8, warmup=False, num_threads=1) as ref:
        want = [o.token_ids for o in ref.generate(PROMPTS, sp)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("TPLLM_TP_AUTHKEY", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")}
    env.update(TPLLM_TP_AUTHKEY_FILE=str(tmp_path / "authkey"), PYTHONPATH=str(REPO),
               OMP_WAIT_POLICY="PASSIVE")
    (tmp_path / "rank0.py").write_text(RANK0)
    logs = {n: open(tmp_path / f"{n}.log", "w+") for n in ("rank0", "node")}

    def tail(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()[-3000:]

    rank0 = subprocess.Popen([*hosts.prefix_a, sys.executable, str(tmp_path / "rank0.py"),
                              str(model), hosts.master, str(hosts.port), json.dumps(PROMPTS)],
                             cwd=REPO,
                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=logs["rank0"], text=True)
    node = None
    try:
        out = _lines(rank0.stdout)
        deadline = time.monotonic() + 60
        while not (tmp_path / "authkey").exists():  # rank 0 writes the key; "copy" it to B
            assert time.monotonic() < deadline and rank0.poll() is None, tail("rank0")
            time.sleep(0.2)
        node = subprocess.Popen([*hosts.prefix_b, sys.executable, "-m",
                                 "backend.parallel.node", "--master-addr", hosts.master,
                                 "--master-port", str(hosts.port), "--ranks", "2",
                                 "--num-threads", "1", "--join-timeout", "60"], cwd=REPO,
                                env=env, stdout=logs["node"], stderr=logs["node"])

        def result(timeout: float = 90) -> dict:
            try:
                return json.loads(out.get(timeout=timeout))
            except queue.Empty:
                raise AssertionError(f"rank 0 silent\n{tail('rank0')}\n{tail('node')}") from None

        def remote_pid() -> int:
            started = [ln for ln in tail("node").splitlines() if "rank 2 started (pid" in ln]
            return int(started[-1].split("pid ")[1].rstrip(")"))

        up = result()
        assert up["tokens"] == want
        seen = {rank0.pid, node.pid, *_descendants(rank0.pid), *_descendants(node.pid)}

        os.kill(remote_pid(), 9)  # the rank on the other host dies
        rank0.stdin.write("step\n")
        rank0.stdin.flush()
        rec = result()
        assert rec["error"] and rec["dead"] and rec["failed_s"] < 5, rec  # not gloo's timeout
        assert rec["tokens"] == want, tail("node")
        seen |= {*_descendants(rank0.pid), *_descendants(node.pid)}

        os.kill(rec["local"][0], 9)  # a local worker dies between steps: on the rebuild the
        rank0.stdin.write("idle\n")  # remote rank is told to rejoin, and does
        rank0.stdin.flush()
        rec = result()
        assert rec["dead"] and rec["tokens"] == want, rec
        assert "rank 2 exited (code 3)" in tail("node")
        seen |= {*_descendants(rank0.pid), *_descendants(node.pid)}

        rank0.stdin.close()
        assert result()["phase"] == "closed"
        assert rank0.wait(30) == 0, tail("rank0")
        assert node.wait(30) == 0, tail("node")  # rank 0 closed the group: the launcher ends
        deadline = time.monotonic() + 10
        while [p for p in seen if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in seen if _alive(p)] == [], tail("node")
    finally:
        for p in (rank0, node):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
        for f in logs.values():
            f.close()
