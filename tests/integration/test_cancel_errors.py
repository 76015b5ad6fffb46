"""Cancelled streams free their KV blocks; invalid requests get errors naming the field while
other streams carry on."""
from __future__ import annotations

import http.client
import json
import queue
import threading
import time

import pytest

from client.generate import ServerError, generate, grpc_inputs

pytestmark = pytest.mark.integration
LONG = {"text_input": "Tell me a very long story about a dragon.", "max_tokens": 2000,
        "ignore_eos": True, "temperature": 0.0, "stream": True}
KV = "llm_kv_cache_blocks_used"


def test_grpc_cancel_frees_kv(server):
    import tritonclient.grpc as grpcclient
    server.wait_metric(KV, lambda v: v == 0)
    idle = server.metric(KV)
    aborts = server.metric("llm_requests_total", finish_reason="abort")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer("llm", grpc_inputs(LONG))
    for _ in range(3):
        result, error = q.get(timeout=60)
        assert error is None
    assert server.wait_metric(KV, lambda v: v > idle) > idle
    client.stop_stream(cancel_requests=True)  # gRPC stream cancel
    client.close()
    t0 = time.monotonic()
    assert server.wait_metric(KV, lambda v: v == idle, timeout=10) == idle
    assert time.monotonic() - t0 < 5
    assert server.wait_metric("llm_requests_total", lambda v: v > aborts,
                              finish_reason="abort") == aborts + 1
    assert server.metric("llm_num_requests_running") == 0


def test_http_stream_close_frees_kv(server):
    server.wait_metric(KV, lambda v: v == 0)
    idle = server.metric(KV)
    conn = http.client.HTTPConnection("localhost", server.http_port, timeout=60)
    conn.request("POST", "/v2/models/llm/generate_stream", json.dumps(LONG))
    resp = conn.getresponse()
    events = 0
    while events < 3:
        if resp.readline().startswith(b"data:"):
            events += 1
    assert server.wait_metric(KV, lambda v: v > idle) > idle
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    assert server.wait_metric(KV, lambda v: v == idle, timeout=10) == idle


BAD_HTTP = [
    ({"text_input": ""}, "text_input"),
    ({"text_input": "x", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "x", "temperature": -1.0}, "temperature"),
    ({"text_input": "x", "top_k": -3}, "top_k"),
    ({"text_input": "x", "max_tokens": 4, "min_tokens": 9}, "min_tokens"),
    ({"text_input": "x", "max_tokens": 1_000_000}, "max_tokens"),
    ({"text_input": "hello " * 9000, "max_tokens": 4}, "text_input"),
    ({"text_input": "x", "beam_width": 2}, "beam_width"),
    ({"text_input": "x", "sampling_parameters": "{not json"}, "sampling_parameters"),
    ({"text_input": "x", "sampling_parameters": '{"temprature": 0}'}, "sampling_parameters"),
    ({"text_input": "x", "parameters": {"top_p": 0}}, "top_p"),
    ({"text_input": "x", "parameters": {"presence_penalty": 9.5}}, "presence_penalty"),
    ({"text_input": "[1, 2]", "chat": True}, "text_input"),
    ({"max_tokens": 4}, "text_input"),
    ({"text_input": ["a", "b"]}, "text_input"),  # rejected by Triton itself (shape)
]


def test_bad_inputs_get_field_errors_while_a_stream_runs(server, greedy):
    want = greedy(LONG["text_input"], 64, ignore_eos=True)
    result: dict = {}

    def stream():
        try:
            result["out"] = generate({**LONG, "max_tokens": 64}, "grpc", server.grpc_url)
        except Exception as e:
            result["out"] = e
    t = threading.Thread(target=stream)
    t.start()
    server.wait_metric("llm_num_requests_running", lambda v: v == 1)
    invalid0 = server.metric("llm_requests_total", finish_reason="invalid")
    for fields, field in BAD_HTTP:
        conn = http.client.HTTPConnection("localhost", server.http_port, timeout=60)
        conn.request("POST", "/v2/models/llm/generate", json.dumps(fields))
        resp = conn.getresponse()
        body = json.loads(resp.read())
        conn.close()
        assert resp.status == 400 and field in body.get("error", ""), (fields, body)
    # gRPC, streaming: the error arrives on the stream
    with pytest.raises(ServerError, match="^.*temperature: must be"):
        generate({"text_input": "x", "temperature": -2.0, "stream": True}, "grpc", server.grpc_url)
    assert t.is_alive(), "the stream should still be running"
    t.join(120)
    assert not t.is_alive() and result["out"]["text"] == want
    assert server.ready()
    assert server.metric("llm_requests_total", finish_reason="invalid") >= invalid0 + 14
