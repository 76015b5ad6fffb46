"""vllm_backend's own contract against our served model.

Additional outputs: the assertions of vllm_backend's ci/L0_additional_outputs_vllm/
additional_outputs_test.py (its request: prompt "In this example,", sampling_parameters
{"temperature": "0", "top_p": "1"[, "logprobs": k]} also sent as request parameters, the
return_* inputs given or not), over a cross-section of its 1,458-case matrix: every flag value
(None, True, False) of every output appears, streaming and not.

Metrics: the vllm:* families (vllm_backend's names and labels model, version) are exported and
move under a load of concurrent streams, time_per_output_token once per token.
"""
from __future__ import annotations

import json
import queue
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.integration
PROMPT = "In this example,"
FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs",
         "return_num_input_tokens", "return_num_output_tokens")


def vllm_test_infer(url: str, stream: bool, sampling: dict, flags: dict) -> list:
    """TestAdditionalOutputs._get_inputs + _llm_infer: each response's InferResult."""
    import tritonclient.grpc as grpcclient
    inputs = []

    def add(name, arr, dt):
        inputs.append(grpcclient.InferInput(name, [1], dt))
        inputs[-1].set_data_from_numpy(arr)
    add("text_input", np.array([PROMPT.encode()], dtype=np.object_), "BYTES")
    add("stream", np.array([stream], dtype=bool), "BOOL")
    add("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_),
        "BYTES")
    for name, v in flags.items():
        if v is not None:
            add(name, np.array([v], dtype=bool), "BOOL")
    results, done = [], threading.Event()
    errors: queue.SimpleQueue = queue.SimpleQueue()

    def callback(result, error):
        if error is not None:
            errors.put(error)
            done.set()
            return
        results.append(result)
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback)
        client.async_stream_infer("llm", inputs=inputs, parameters=sampling)
        assert done.wait(300), "no final response"
        client.stop_stream()
    assert errors.empty(), errors.get().message()
    return results


def check_like_vllm_backend(results: list, stream: bool, sampling: dict, flags: dict,
                            final_reason: str) -> None:
    """Its _assert_* methods, in order. `final_reason`: the offline engine's for this greedy
    request (vllm_backend's model, OPT-125m, runs to max_tokens: "length"; SmolLM2 may stop
    earlier at its end token)."""
    text = "".join(r.as_numpy("text_output")[0].decode() for r in results)
    assert text and text.count(" ") > 4, text
    want = {f: flags.get(f) is True for f in FLAGS}
    prev = 0.0
    for i, r in enumerate(results):
        fr = r.as_numpy("finish_reason")
        if not want["return_finish_reason"]:
            assert fr is None
        else:
            assert fr[0].decode() == (final_reason if i == len(results) - 1 else "None")
        cl = r.as_numpy("cumulative_logprob")
        if not want["return_cumulative_logprob"]:
            assert cl is None
        else:
            assert float(cl[0]) != prev
            prev = float(cl[0])
        lp = r.as_numpy("logprobs")
        if not want["return_logprobs"]:
            assert lp is None
        else:
            body = json.loads(lp[0].decode())
            if "logprobs" not in sampling:
                assert body is None
            else:
                assert isinstance(body, list) and len(body) >= 1
                if want["return_num_output_tokens"]:
                    assert len(body) == int(r.as_numpy("num_output_tokens")[0])
                chosen = ""
                for pos in body:
                    assert 1 <= len(pos) <= sampling["logprobs"] + 1
                    ranks = [e["rank"] for e in pos.values()]
                    assert ranks.count(1) == 1
                    for tid, e in pos.items():
                        assert isinstance(tid, str) and len(e) == 3
                        assert isinstance(e["logprob"], float) and isinstance(e["rank"], int)
                        assert isinstance(e["decoded_token"], str)
                    chosen += next(e["decoded_token"] for e in pos.values() if e["rank"] == 1)
                out = r.as_numpy("text_output")[0].decode()
                assert (chosen if stream else PROMPT + chosen) == out
        ni = r.as_numpy("num_input_tokens")
        if not want["return_num_input_tokens"]:
            assert ni is None
        else:
            assert ni.dtype == np.uint32 and 0 < int(ni[0]) <= len(PROMPT)
        no = r.as_numpy("num_output_tokens")
        if not want["return_num_output_tokens"]:
            assert no is None
        else:
            assert no.dtype == np.uint32 and int(no[0]) > 0


# (finish_reason, cumulative_logprob, logprobs k, return_logprobs, num_input, num_output)
CASES = [
    (None, None, None, None, None, None),
    (True, True, 2, True, True, True),
    (False, False, 0, False, False, False),
    (True, None, 0, True, False, True),
    (None, True, None, True, True, None),
    (False, True, 2, None, True, False),
    (True, False, None, False, None, True),
]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_additional_outputs_as_vllm_backend(server, offline, stream, case):
    from backend import SamplingParams
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))[0]
    finish, cumulative, k, ret_lp, n_in, n_out = case
    sampling = {"temperature": "0", "top_p": "1"}
    if k is not None:
        sampling["logprobs"] = k
    flags = dict(zip(FLAGS, (finish, cumulative, ret_lp, n_in, n_out)))
    results = vllm_test_infer(server.grpc_url, stream, sampling, flags)
    check_like_vllm_backend(results, stream, sampling, flags, ref.finish_reason)


VLLM_FAMILIES = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count",
                 "vllm:time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_prompt_tokens_count",
                 "vllm:request_generation_tokens_count", "vllm:request_params_n_count",
                 "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total")


def test_vllm_metric_families_move_under_load(server):
    """Concurrent streams: while they run, the running gauge and KV usage are seen above 0 on
    /metrics; afterwards the token counters and per-token histogram moved by exactly what was
    generated (time_per_output_token: tokens - 1 per request)."""
    from client.generate import generate
    n_req, n_tok = 6, 24
    labels = {"model": "llm", "version": "1"}
    for name in VLLM_FAMILIES:
        server.metric(name, **labels)  # every family exported (KeyError if not)
    before = {name: server.metric(name, **labels) for name in VLLM_FAMILIES}
    outs: list = [None] * n_req

    def one(i):
        outs[i] = generate({"text_input": f"Request {i}: tell me a story about the sea.",
                            "max_tokens": n_tok, "ignore_eos": True, "temperature": 0.0,
                            "stream": True}, "grpc", server.grpc_url)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_req)]
    for t in threads:
        t.start()
    running = server.wait_metric("vllm:num_requests_running", lambda v: v > 0, timeout=120,
                                 **labels)
    usage = server.wait_metric("vllm:kv_cache_usage_perc", lambda v: v > 0, timeout=120,
                               **labels)
    for t in threads:
        t.join(600)
    assert running > 0 and 0 < usage <= 1
    assert all(o and o["num_output_tokens"] == n_tok for o in outs)
    prompt_tokens = sum(o["num_input_tokens"] for o in outs)

    def moved(name):
        return server.metric(name, **labels) - before[name]
    server.wait_metric("vllm:e2e_request_latency_seconds_count",
                       lambda v: v >= before["vllm:e2e_request_latency_seconds_count"] + n_req,
                       timeout=30, **labels)
    assert moved("vllm:generation_tokens_total") == n_req * n_tok
    assert moved("vllm:prompt_tokens_total") == prompt_tokens
    assert moved("vllm:time_to_first_token_seconds_count") == n_req
    assert moved("vllm:time_per_output_token_seconds_count") == n_req * (n_tok - 1)
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:request_prompt_tokens_count",
                 "vllm:request_generation_tokens_count", "vllm:request_params_n_count"):
        assert moved(name) == n_req, name
    assert moved("vllm:prefix_cache_queries_total") > 0
    # idle again: the gauges come back down
    server.wait_metric("vllm:num_requests_running", lambda v: v == 0, timeout=30, **labels)
    assert server.metric("vllm:num_requests_running", **labels) == 0
