"""Parallel sampling (n > 1) served, on vllm_backend's layout: every per-sequence output has one
element per sample (text_output [n], finish_reason [n], ...); streamed, each response carries
every sample's delta at its index; not streamed, one response with n whole texts."""
from __future__ import annotations

import http.client
import json

import numpy as np
import pytest

from tests.integration.grpc_stream import stream_request

pytestmark = pytest.mark.integration
PROMPT = "Once upon a time, in a small village by the sea,"
KV = "llm_kv_cache_blocks_used"
FLAGS = ("return_finish_reason", "return_num_output_tokens", "return_num_input_tokens",
         "return_cumulative_logprob")


def grpc_responses(url: str, stream: bool, sampling: dict, exclude_input: bool | None = None,
                   cancel_after: int | None = None) -> list:
    """vllm_backend's client request (text_input, stream, sampling_parameters JSON, return_*
    flags); each response's InferResult, until the final one (or `cancel_after` responses)."""
    tensors = {"text_input": (np.array([PROMPT.encode()], dtype=np.object_), "BYTES"),
               "stream": (np.array([stream], dtype=bool), "BOOL"),
               "sampling_parameters": (np.array([json.dumps(sampling).encode()],
                                                dtype=np.object_), "BYTES")}
    for f in FLAGS:
        tensors[f] = (np.array([True]), "BOOL")
    if exclude_input is not None:
        tensors["exclude_input_in_output"] = (np.array([exclude_input]), "BOOL")
    return stream_request(url, tensors, cancel_after)


def _texts(results: list, n: int) -> list[str]:
    texts = [""] * n
    for r in results:
        out = r.as_numpy("text_output")
        assert out.shape == (n,)
        for i, t in enumerate(out):
            texts[i] += t.decode()
    return texts


def test_seeded_samples_stream_as_they_return_whole(server):
    sampling = {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 24}
    streamed = grpc_responses(server.grpc_url, True, sampling)
    whole = grpc_responses(server.grpc_url, False, sampling)
    assert len(whole) == 1 and len(streamed) > 1
    texts = _texts(streamed, 3)
    assert [PROMPT + t for t in texts] == _texts(whole, 3)  # the prompt prepended, not streamed
    assert len(set(texts)) == 3, texts
    final = whole[0]
    assert final.as_numpy("num_input_tokens").shape == (1,)
    counts = final.as_numpy("num_output_tokens")
    assert counts.shape == (3,) and all(1 <= c <= 24 for c in counts)
    # streamed counts are per response and per sample: they add up to the whole reply's
    assert list(sum(r.as_numpy("num_output_tokens").astype(int) for r in streamed)) == \
        list(counts)
    reasons = [r.decode() for r in final.as_numpy("finish_reason")]
    assert all(r in ("stop", "length") for r in reasons)
    assert final.as_numpy("cumulative_logprob").shape == (3,)
    # a sample's finish_reason is "None" until it ends, then stays its own
    for r in streamed[:-1]:
        assert set(x.decode() for x in r.as_numpy("finish_reason")) <= {"None", "stop", "length"}
    assert [r.decode() for r in streamed[-1].as_numpy("finish_reason")] == reasons


def test_greedy_samples_are_the_greedy_text(server, greedy):
    sampling = {"n": 4, "temperature": 0, "max_tokens": 16}
    whole = grpc_responses(server.grpc_url, False, sampling, exclude_input=True)
    assert _texts(whole, 4) == [greedy(PROMPT, 16)] * 4


def test_http_generate_returns_arrays(server):
    conn = http.client.HTTPConnection("localhost", server.http_port, timeout=300)
    body = {"text_input": PROMPT, "max_tokens": 8, "temperature": 0, "n": 2,
            "exclude_input_in_output": True, "return_finish_reason": True}
    conn.request("POST", "/v2/models/llm/generate", json.dumps(body))
    resp = conn.getresponse()
    data = json.loads(resp.read())
    assert resp.status == 200, data
    assert isinstance(data["text_output"], list) and len(data["text_output"]) == 2
    assert data["text_output"][0] == data["text_output"][1]
    assert isinstance(data["finish_reason"], list) and len(data["finish_reason"]) == 2


def test_cancel_frees_every_sample(server):
    server.wait_metric(KV, lambda v: v == 0)
    sampling = {"n": 4, "temperature": 1.0, "max_tokens": 2000, "ignore_eos": True}
    got = grpc_responses(server.grpc_url, True, sampling, cancel_after=3)
    assert len(got) == 3
    assert server.wait_metric(KV, lambda v: v == 0, timeout=30) == 0
    assert server.metric("llm_num_requests_running") == 0


@pytest.mark.parametrize("field,value,match", [
    ("n", 0, "sampling_parameters.n: must be >= 1"),
    ("n", 17, "sampling_parameters.n: at most max_num_seqs (16)"),
    ("best_of", 2, "best_of: only 1 is supported")])
def test_bad_n_is_the_requests_error(server, field, value, match):
    from tritonclient.utils import InferenceServerException
    with pytest.raises(InferenceServerException, match=match.replace("(", r"\(").replace(")", r"\)")):
        grpc_responses(server.grpc_url, False, {field: value, "max_tokens": 4})
