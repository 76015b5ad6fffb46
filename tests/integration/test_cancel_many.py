"""100 clients that cancel or disconnect at every point of a request's life (before the first
token, during the prefill of a long prompt, mid-decode), over gRPC stream cancel and HTTP
generate_stream disconnect: afterwards every KV block is free and the server still answers
correctly. Also the non-streaming HTTP generate path (issue #7, item 7)."""
from __future__ import annotations

import http.client
import json
import queue
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from client.generate import generate, grpc_inputs

pytestmark = pytest.mark.integration
KV = "llm_kv_cache_blocks_used"
LONG_PROMPT = "Here is a long list of facts about rivers, mountains and cities. " * 80  # ~1k tokens


def _fields(prompt: str) -> dict:
    return {"text_input": prompt, "max_tokens": 400, "ignore_eos": True, "temperature": 0.0,
            "stream": True}


def grpc_cancel(url: str, prompt: str, point: str, rng: random.Random) -> str:
    """One request over a gRPC stream, cancelled at `point`; returns what the client saw."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer("llm", grpc_inputs(_fields(prompt)))
        if point == "prefill":
            time.sleep(rng.uniform(0.05, 0.6))
            if not q.empty():
                return "token arrived before the cancel"
        elif point == "decode":
            for _ in range(rng.randint(1, 5)):
                result, error = q.get(timeout=120)
                if error is not None:
                    return f"error: {error}"
        return "ok"
    finally:
        client.stop_stream(cancel_requests=True)  # gRPC stream cancel
        client.close()


def http_disconnect(port: int, prompt: str, point: str, rng: random.Random) -> str:
    """One generate_stream request whose client goes away at `point`."""
    conn = http.client.HTTPConnection("localhost", port, timeout=120)
    try:
        conn.request("POST", "/v2/models/llm/generate_stream", json.dumps(_fields(prompt)))
        if point == "prefill":
            time.sleep(rng.uniform(0.05, 0.6))
        elif point == "decode":
            resp = conn.getresponse()
            events, want = 0, rng.randint(1, 5)
            while events < want:
                line = resp.readline()
                if not line:
                    return "stream ended early"
                if line.startswith(b"data:"):
                    if b'"error"' in line:
                        return f"error: {line[:200]!r}"
                    events += 1
        return "ok"
    finally:
        if conn.sock is not None:
            conn.sock.shutdown(socket.SHUT_RDWR)  # the client vanishes
        conn.close()


def test_100_cancellations_free_every_kv_block(server, greedy):
    assert server.wait_metric(KV, lambda v: v == 0, timeout=60) == 0
    idle = server.metric(KV)
    total = server.metric("llm_kv_cache_blocks_total")
    aborts0 = server.metric("llm_requests_total", default=0.0, finish_reason="abort")
    rng = random.Random(7)
    # (protocol, point, prompt): 100 in all, every combination
    plan = []
    for i in range(100):
        protocol = ("grpc", "http")[i % 2]
        point = ("before_first_token", "prefill", "decode", "decode")[(i // 2) % 4]
        prompt = LONG_PROMPT if point == "prefill" else f"Request {i}: tell me about the sea."
        plan.append((protocol, point, prompt, random.Random(rng.random())))
    rng.shuffle(plan)

    def run(item):
        protocol, point, prompt, r = item
        if protocol == "grpc":
            return grpc_cancel(server.grpc_url, prompt, point, r)
        return http_disconnect(server.http_port, prompt, point, r)
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        seen = list(pool.map(run, plan))
    assert all(s in ("ok", "token arrived before the cancel") for s in seen), seen
    busy = server.metric(KV)
    freed = server.wait_metric(KV, lambda v: v == idle, timeout=60)
    assert freed == idle, f"{freed} of {total} KV blocks still used after 100 cancellations " \
                          f"({busy} right after the last one)"
    assert server.wait_metric("llm_num_requests_running", lambda v: v == 0) == 0
    assert server.metric("llm_num_requests_waiting") == 0
    aborts = server.wait_metric("llm_requests_total", lambda v: v >= aborts0 + 75,
                                finish_reason="abort") - aborts0
    # all that got a token (50 mid-decode) or were prefilling (25) reached the engine and were
    # aborted there; the other 25 may have been cancelled before the model saw them
    assert 75 <= aborts <= 100, aborts
    prompt = "The capital of France is"
    assert generate({"text_input": prompt, "max_tokens": 12, "temperature": 0.0,
                     "stream": True}, "grpc", server.grpc_url)["text"] == greedy(prompt, 12)
    assert server.ready()
    print(f"100 cancellations in {time.monotonic() - t0:.1f}s; KV {busy:.0f} -> {freed:.0f}")


def test_http_generate_with_stream_true_is_refused(server):
    """HTTP generate allows one response: with `stream: true` Triton fails the request (after
    the model produced it; documented in model_repository/README.md) and KV is freed."""
    status, raw = None, b""
    conn = http.client.HTTPConnection("localhost", server.http_port, timeout=120)
    conn.request("POST", "/v2/models/llm/generate", json.dumps(
        {"text_input": "Count to ten:", "max_tokens": 24, "ignore_eos": True, "stream": True}))
    resp = conn.getresponse()
    status, raw = resp.status, resp.read()
    conn.close()
    assert "generate expects model to produce exactly 1 response" in raw.decode(), (status, raw)
    assert server.wait_metric(KV, lambda v: v == 0, timeout=30) == 0
    assert server.ready()


@pytest.mark.xfail(strict=True, reason="Triton's HTTP frontend does not read a connection while a "
                   "non-streaming generate request runs, so the model cannot learn that the "
                   "client left (see model_repository/README.md, Errors)")
def test_http_generate_client_disconnect_stops_generation(server):
    """Judged by tokens, not by a deadline: a request that keeps running for a client that is
    gone produces all max_tokens, one that is stopped fewer. (It waited 3 s for the KV to be
    freed: on a fast host the whole 200 tokens finished inside that, an XPASS.)"""
    max_tokens = 400
    assert server.wait_metric(KV, lambda v: v == 0, timeout=60) == 0
    gen0 = server.metric("llm_generation_tokens_total")
    conn = http.client.HTTPConnection("localhost", server.http_port, timeout=60)
    conn.request("POST", "/v2/models/llm/generate", json.dumps(
        {"text_input": "Tell me a story.", "max_tokens": max_tokens, "ignore_eos": True}))
    server.wait_metric(KV, lambda v: v > 0, timeout=30)
    time.sleep(0.5)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    t0 = time.monotonic()
    try:
        server.wait_metric("llm_num_requests_running", lambda v: v == 0, timeout=300)
        # the counters refresh every 0.1 s: all max_tokens shows up at once, fewer by the timeout
        generated = server.wait_metric("llm_generation_tokens_total",
                                       lambda v: v - gen0 >= max_tokens, timeout=5) - gen0
        assert generated < max_tokens, "generated every token for a client that is gone"
    finally:
        print(f"generated {server.metric('llm_generation_tokens_total') - gen0:.0f} tokens "
              f"({time.monotonic() - t0:.1f}s) after the client left")
