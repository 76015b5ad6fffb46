"""Tensor parallelism across hosts behind the real server: rank 0 in tritonserver, rank 1 under
`python -m backend.parallel.node` on another "host" (a second loopback address, as in
tests/test_multihost.py: rank 0 serves the group on 127.0.0.2, the launcher's rank reaches it
from 127.0.0.1). The multi-host parameters reach the stock config.pbtxt through the server's
environment ("${TPLLM_...}", as deploy/kubernetes/ sets them).

Greedy tokens equal TP1's; the launcher killed mid-stream ends that stream with an error naming
the lost rank and its host (no library internals) and new requests are refused while rank 0
waits to rebuild the group; the launcher back, the group is rebuilt, counted in the llm_*
metrics, and serves TP1's tokens again."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time

import pytest

from client.generate import ServerError, generate, grpc_inputs
from client.server import ROOT, START_TIMEOUT, Server, make_repo
from backend.engine.tp.channel import route_address
from tests.integration.conftest import BASE_PARAMS
from tests.test_multihost import LOOPBACK_MASTER, _free_port_pair

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PROMPT = "The capital of France is"
# Deadlines, not expectations: a loaded CI machine is slow. The failure itself comes from the
# dead rank's sockets closing (the issue measured 0.1 s), not from a collective timeout.
STREAM_FAILS_S = 60
REBUILT_S = 600


def _greedy(srv: Server, max_tokens: int = 8) -> str:
    return generate({"text_input": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
                     "stream": True}, "grpc", srv.grpc_url)["text"]


def _start_node(master: str, port: int, env: dict, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "backend.parallel.node", "--master-addr", master,
         "--master-port", str(port), "--ranks", "1", "--num-threads", "1",
         "--join-timeout", "600"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_tp_across_hosts_through_the_server(tmp_path, greedy):
    master, port = LOOPBACK_MASTER, _free_port_pair(LOOPBACK_MASTER)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "TPLLM_TP_AUTHKEY_FILE")}
    env.update(TPLLM_TP_AUTHKEY="k8s-test-" + os.urandom(16).hex(), OMP_WAIT_POLICY="PASSIVE")
    server_env = {**env, "TPLLM_TENSOR_PARALLEL_SIZE": "2", "TPLLM_TP_LOCAL_RANKS": "1",
                  "TPLLM_TP_MASTER_ADDR": master, "TPLLM_TP_MASTER_PORT": str(port)}
    # no warm-up: the test is about the group, and a rebuild warms up again
    repo = make_repo(tmp_path / "repo", {**BASE_PARAMS, "num_threads": "1", "warmup": "false",
                                         "tp_collective_timeout_s": "30"})
    node_log = open(tmp_path / "node.log", "wb")
    srv = Server(repo, tmp_path / "server.log", env=server_env)
    node = None
    try:
        node = _start_node(master, port, env, node_log)
        srv.wait_ready(max(START_TIMEOUT, 600))  # two processes load the model, one after another
        assert "tensor_parallel_size=2" in srv.log(100000), srv.log()
        want = greedy(PROMPT, 8)
        assert _greedy(srv) == want
        assert srv.metric("llm_tp_group_rebuilds_total") == 0

        import tritonclient.grpc as grpcclient
        events: queue.Queue = queue.Queue()
        c = grpcclient.InferenceServerClient(srv.grpc_url)
        c.start_stream(callback=lambda result, error: events.put((time.monotonic(), error)))
        c.async_stream_infer("llm", grpc_inputs({
            "text_input": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0.0, "stream": True}))
        _, error = events.get(timeout=120)  # producing
        assert error is None, error
        node.kill()  # the launcher: its rank dies with it
        killed = time.monotonic()
        node.wait(30)
        while True:
            t, error = events.get(timeout=STREAM_FAILS_S)
            if error is not None:
                break
        failed_after = t - killed
        message = error.message()
        c.stop_stream()
        c.close()
        host = route_address(master, port)  # where rank 1 joined from
        assert f"tensor-parallel rank 1 (the worker on host {host}) was lost" in message, message
        assert "being rebuilt" in message, message
        for internal in ("gloo", ".cc:", "/__w/", "third_party", "Traceback"):
            assert internal not in message, message
        assert "Read error" in srv.log(200000) or "engine step failed" in srv.log(200000)

        # while rank 0 waits for the rank to come back, new requests are refused, clearly
        with pytest.raises(ServerError, match=r"rank 1 .* was lost; the tensor-parallel group "
                                              r"is being rebuilt"):
            _greedy(srv)
        assert srv.ready()  # the server itself is up: only this model's group is down

        node = _start_node(master, port, env, node_log)  # the launcher is back
        back = time.monotonic()
        deadline = back + REBUILT_S
        while True:
            try:
                again = _greedy(srv)
                break
            except ServerError as e:
                assert "being rebuilt" in str(e), e
                assert time.monotonic() < deadline, f"not rebuilt in {REBUILT_S}s\n{srv.log()}"
                time.sleep(1.0)
        print(f"stream failed {failed_after:.2f}s after the kill: {message!r}; serving again "
              f"{time.monotonic() - back:.1f}s after the launcher came back")
        assert again == want
        assert srv.wait_metric("llm_tp_group_rebuilds_total", lambda v: v >= 1) == 1
        assert srv.metric("llm_requests_total", finish_reason="error") >= 1
        srv.stop()  # the model unloads and closes the group: the launcher ends by itself
        assert node.wait(60) == 0, (tmp_path / "node.log").read_text()[-3000:]
    finally:
        srv.stop()
        _stop(node)
        node_log.close()
