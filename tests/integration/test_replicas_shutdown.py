"""instance_group count: 2 serves from two replicas; SIGINT or SIGTERM with streams in flight ends
every stream (final response or error) and leaves no process or shared-memory segment behind."""
from __future__ import annotations

import os
import queue
import signal
import threading
import time

import pytest

from client.generate import generate, grpc_inputs
from tests.integration import proctree
from tests.integration.conftest import BASE_PARAMS, NO_WARMUP, Server, make_repo

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("tp", [1, 2])
def test_two_replicas_serve(start_server, greedy, tp):
    """With TP 2 each replica owns its own group: two workers, two segments, one answer."""
    srv = start_server(f"replicas_tp{tp}", params={"num_threads": "1", **NO_WARMUP,
                                                   "tensor_parallel_size": str(tp)}, count=2)
    workers = [p for p in proctree.tree(srv.proc.pid) if proctree.role(p) == "tp_worker"]
    assert len(workers) == 2 * (tp - 1), [(p, proctree.role(p)) for p in proctree.tree(srv.proc.pid)]
    prompts = [f"Count with me: {i}, {i + 1}," for i in range(8)]
    results: list = [None] * len(prompts)

    def run(i):
        results[i] = generate({"text_input": prompts[i], "max_tokens": 12, "temperature": 0.0,
                               "stream": True}, "grpc", srv.grpc_url)["text"]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert results == [greedy(p, 12) for p in prompts]
    per_instance = {inst: srv.wait_metric("llm_requests_total", lambda v: v > 0, timeout=5,
                                          instance=inst)
                    for inst in ("llm_0_0", "llm_0_1")}
    assert all(v > 0 for v in per_instance.values()), per_instance
    assert sum(per_instance.values()) == len(prompts)
    srv.stop()
    assert srv.group_alive() == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_with_streams_in_flight(start_server, sig):
    """TP 2, so the tensor-parallel worker and its shared-memory segment are part of the check."""
    srv = start_server(f"shutdown_{sig.name}", params={**NO_WARMUP, "tensor_parallel_size": "2",
                                                        "num_threads": "1"},
                       extra=["--exit-timeout-secs", "5"])
    import tritonclient.grpc as grpcclient
    endings: list = []
    clients = []
    for i in range(3):
        q: queue.Queue = queue.Queue()
        c = grpcclient.InferenceServerClient(srv.grpc_url)
        c.start_stream(callback=lambda result, error, q=q: q.put((result, error)))
        c.async_stream_infer("llm", grpc_inputs(
            {"text_input": f"Story number {i}:", "max_tokens": 800, "ignore_eos": True,
             "stream": True, "temperature": 0.0}), enable_empty_final_response=True)
        clients.append((c, q))
    for _, q in clients:  # every stream is producing
        result, error = q.get(timeout=60)
        assert error is None, (error.status(), error.message(), srv.log())
    pids = proctree.tree(srv.proc.pid)
    ids = proctree.identities(pids)
    roles = {p: proctree.role(p) for p in pids}
    shm = proctree.shm_segments(pids)
    assert {proctree.role(p) for p in pids} >= {"launcher", "tritonserver", "stub", "tp_worker"}
    assert any("/tpllm_" in s for s in shm) and any("triton_python_backend_shm" in s for s in shm), shm
    srv.proc.send_signal(sig)
    for c, q in clients:
        deadline = time.monotonic() + 60
        ending = None
        while ending is None and time.monotonic() < deadline:
            try:
                result, error = q.get(timeout=1)
            except queue.Empty:
                continue
            if error is not None:
                ending = ("error", str(error))
            elif result.get_response().parameters["triton_final_response"].bool_param:
                ending = ("final", "")
        endings.append(ending)
        c.stop_stream()
        c.close()
    assert all(e is not None for e in endings), endings
    assert srv.proc.wait(60) == 0, srv.log()
    left = proctree.left_after(ids)
    assert left == [], [(roles[p], p, st) for p, st, _ in left]  # no orphan, no zombie
    assert srv.group_alive() == [], srv.log()
    assert [s for s in shm if os.path.exists(s)] == [], "shared memory left behind"
    log = srv.log(50000)
    assert "aborted 3 request(s) still in flight" in log or \
        "unloading: 3 request(s) in flight" in log, log
    assert "successfully unloaded" in log, log
    assert "Exit timeout expired" not in log


def test_load_error_says_why(tmp_path):
    repo = make_repo(tmp_path / "repo", {**BASE_PARAMS, "model": "/nonexistent/model"})
    srv = Server(repo, tmp_path / "server.log")
    try:
        srv.proc.wait(120)  # tritonserver exits when a model fails to load
        log = srv.log(50000)
        assert "cannot load the engine: /nonexistent/model: model directory not found" in log
        assert not srv.ready()
    finally:
        srv.stop()
    assert srv.group_alive() == []
