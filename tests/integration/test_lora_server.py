"""LoRA through the real tritonserver: adapters from multi_lora.json (a path relative to the
version folder), lora_name in sampling_parameters (gRPC) and as a request parameter (HTTP
generate) giving the offline engine's greedy text with that adapter; an unknown name is an
error for that request only; requests counted per adapter; nothing cold after READY."""
from __future__ import annotations

import http.client
import json

import pytest

from backend import LLM, SamplingParams
from backend.model.config import ModelConfig
from client.bench.bench_lora import write_random_adapter
from client.generate import generate
from client.server import Server, make_repo
from tests.conftest import SMALL_ENGINE
from tests.integration.conftest import BASE_PARAMS

pytestmark = pytest.mark.integration

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TOKENS = 16


def _http(server, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("localhost", server.http_port, timeout=120)
    conn.request("POST", "/v2/models/llm/generate", json.dumps(body))
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, default_model_dir):
    d = tmp_path_factory.mktemp("lora")
    repo = make_repo(d / "repo", {**BASE_PARAMS, "enable_lora": "true", "max_lora_rank": "8",
                                   "max_num_batched_tokens": "256"})
    version = repo / "llm" / "1"
    adapter = write_random_adapter(version / "adapters" / "doll",
                                   ModelConfig.from_dir(default_model_dir), rank=8, seed=11)
    (version / "multi_lora.json").write_text(json.dumps({"doll": "adapters/doll"}))
    srv = Server(repo, d / "server.log")
    try:
        srv.wait_ready()
        yield srv, adapter
    finally:
        srv.stop()


def test_lora_requests_match_offline(lora_server, default_model_dir):
    server, adapter = lora_server
    with LLM(model=str(default_model_dir), enable_lora=True, max_lora_rank=8,
             lora_modules={"doll": str(adapter)}, **SMALL_ENGINE) as llm:
        sp = [SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, lora_name=n)
              for n in (None, "doll")]
        want = {(p, n): llm.generate(p, s)[0].text
                for p in PROMPTS for n, s in zip((None, "doll"), sp)}
    assert any(want[(p, None)] != want[(p, "doll")] for p in PROMPTS)  # the adapter matters
    for p in PROMPTS:
        status, body = _http(server, {"text_input": p, "parameters": {
            "lora_name": "doll", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}})
        # a non-streamed HTTP generate answers prompt + completion (test_streaming.py)
        assert status == 200 and body["text_output"] == p + want[(p, "doll")]
        sp = json.dumps({"lora_name": "doll", "max_tokens": TOKENS, "temperature": 0,
                         "ignore_eos": True})
        out = generate({"text_input": p, "stream": True, "sampling_parameters": sp}, "grpc",
                       server.grpc_url)
        assert out["text"] == want[(p, "doll")]
        status, body = _http(server, {"text_input": p, "parameters": {
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}})
        assert status == 200 and body["text_output"] == p + want[(p, None)]
    status, body = _http(server, {"text_input": PROMPTS[0], "parameters": {"lora_name": "zzz"}})
    assert status == 400 and "lora_name: unknown LoRA adapter 'zzz'" in body["error"]
    status, _ = _http(server, {"text_input": PROMPTS[0], "parameters": {"lora_name": "doll"}})
    assert status == 200  # still serving
    assert server.wait_metric("llm_lora_requests_total", lambda v: v >= 5, lora_name="doll") == 5
    cold = server.settled_metrics(("llm_cold_path_events_total",))
    assert cold["llm_cold_path_events_total"] == 0
