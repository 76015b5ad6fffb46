"""Streaming and one-shot generation through the real tritonserver equal the offline engine."""
from __future__ import annotations

import json
import queue
import threading

import pytest

from client.generate import generate, grpc_inputs

pytestmark = pytest.mark.integration
PROMPT = "The capital of France is"


def grpc_stream_raw(url: str, fields: dict) -> list[bytes]:
    """tritonclient start_stream / async_stream_infer, as a user would write it."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer("llm", grpc_inputs(fields), enable_empty_final_response=True)
    chunks = []
    try:
        while True:
            result, error = q.get(timeout=120)
            assert error is None, error
            resp = result.get_response()
            if resp.outputs:
                chunks.append(result.as_numpy("text_output").reshape(-1)[0])
            if resp.parameters["triton_final_response"].bool_param:
                return chunks
    finally:
        client.stop_stream()
        client.close()


def test_grpc_stream_equals_offline_greedy(server, greedy):
    chunks = grpc_stream_raw(server.grpc_url, {"text_input": PROMPT, "max_tokens": 32,
                                               "temperature": 0.0, "stream": True})
    assert len(chunks) > 10  # really streamed
    text = "".join(c.decode("utf-8") for c in chunks)  # every chunk is valid UTF-8 on its own
    assert text == greedy(PROMPT, 32)


def test_http_stream_and_generate_equal_offline(server, greedy, offline):
    want = greedy(PROMPT, 32)
    fields = {"text_input": PROMPT, "max_tokens": 32, "temperature": 0.0}
    out = generate({**fields, "stream": True}, "http", server.http_url)
    assert out["text"] == want and out["responses"] > 10
    from backend import SamplingParams
    ref = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=32))[0]
    assert (out["finish_reason"], out["num_input_tokens"], out["num_output_tokens"]) == \
        (ref.finish_reason, ref.num_input_tokens, ref.num_output_tokens)
    one = generate({**fields, "exclude_input_in_output": True}, "http", server.http_url)
    assert one["responses"] == 1 and one["text"] == want
    full = generate(fields, "http", server.http_url)  # non-streaming default: prompt + completion
    assert full["responses"] == 1 and full["text"] == PROMPT + want


def test_concurrent_streams_batch_in_flight(server, greedy):
    prompts = [f"Write a short note about the number {i}:" for i in range(8)]
    wants = [greedy(p, 24) for p in prompts]
    steps0 = server.metric("llm_engine_steps_total")
    sampled0 = server.metric("llm_engine_sampled_tokens_total")
    results: list = [None] * 8

    def run(i):
        try:
            results[i] = generate({"text_input": prompts[i], "max_tokens": 24, "temperature": 0.0,
                                   "stream": True}, "grpc", server.grpc_url)["text"]
        except Exception as e:  # reported below
            results[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert results == wants
    steps = server.wait_metric("llm_engine_steps_total", lambda v: v > steps0) - steps0
    sampled = server.wait_metric("llm_engine_sampled_tokens_total",
                                 lambda v: v >= sampled0 + 8 * 24) - sampled0
    assert sampled == 8 * 24
    assert sampled / steps > 3, f"no in-flight batching: {sampled} tokens in {steps} steps"
    assert server.metric("llm_time_to_first_token_seconds_count") >= 8
    assert server.metric("llm_inter_token_latency_seconds_count") >= 8  # one per request


def test_genai_perf_payloads(server, greedy):
    want = greedy(PROMPT, 16)
    # --backend tensorrtllm: tensors text_input, max_tokens, stream, exclude_input_in_output, min_length
    trt = generate({"text_input": PROMPT, "max_tokens": 16, "stream": True, "min_length": 16,
                    "exclude_input_in_output": True, "temperature": 0.0}, "grpc", server.grpc_url)
    assert trt["num_output_tokens"] == 16 and trt["text"] == want
    # --backend vllm: sampling_parameters JSON (values may be strings)
    sp = json.dumps({"max_tokens": "16", "min_tokens": "16", "temperature": 0, "ignore_eos": "true"})
    vllm = generate({"text_input": PROMPT, "stream": True, "exclude_input_in_output": True,
                     "sampling_parameters": sp}, "http", server.http_url)
    assert vllm["text"] == want
    # HTTP generate `parameters` (request parameters)
    import http.client
    conn = http.client.HTTPConnection("localhost", server.http_port, timeout=120)
    conn.request("POST", "/v2/models/llm/generate", json.dumps(
        {"text_input": PROMPT, "parameters": {"max_tokens": 16, "temperature": 0.0,
                                              "exclude_input_in_output": True}}))
    body = json.loads(conn.getresponse().read())
    assert body["text_output"] == want, body


def test_chat_mode_applies_the_template(server, offline):
    from backend import SamplingParams
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = offline.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0].text
    out = generate({"text_input": json.dumps(msgs), "chat": True, "max_tokens": 20,
                    "temperature": 0.0}, "http", server.http_url)
    assert out["text"] == want and "Paris" in want


def test_cumulative_logprob_on_request(server, offline, hf_smollm):
    """The server's cumulative_logprob is transformers' log_softmax summed over the greedy
    output (the offline engine's tokens: the server's text equals them, see above)."""
    from backend import SamplingParams
    from tests.test_model_fidelity import hf_output_logprob
    out = generate({"text_input": PROMPT, "max_tokens": 4, "temperature": 0.0, "stream": True,
                    "exclude_input_in_output": True, "return_cumulative_logprob": True}, "grpc",
                   server.grpc_url)
    ref = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4))[0]
    assert out["text"] == ref.text
    want = hf_output_logprob(hf_smollm, offline.tokenizer.encode(PROMPT), ref.token_ids)
    assert isinstance(out["cumulative_logprob"], float)
    assert out["cumulative_logprob"] == pytest.approx(want, rel=1e-4, abs=1e-4)


def test_nothing_cold_after_ready(server):
    """Warmup ran every step shape before READY: the streams above hit none for the first time.
    (metric() raises for a series that is not exported; without warmup the same series counts:
    test_kv_pressure.)"""
    cold = server.settled_metrics(("llm_cold_path_events_total",))  # the last refresh's too
    assert cold["llm_cold_path_events_total"] == 0
