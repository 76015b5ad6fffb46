"""Cancelled streams free their KV blocks; invalid requests get errors naming the field while
other streams carry on."""
from __future__ import annotations

import http.client
import json
import queue
import threading
import time

import numpy as np
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
    aborts = server.metric("llm_requests_total", default=0.0, finish_reason="abort")
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
    # Freed by the cancellation, not by the end of the 2000-token generation (minutes); the
    # bound leaves a loaded machine room for the responder's poll and the engine's next step.
    assert server.wait_metric(KV, lambda v: v == idle, timeout=20) == idle
    assert time.monotonic() - t0 < 20
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


def _sp(**kw) -> str:
    return json.dumps(kw)


# (request body of HTTP generate, the field its error must start with / name). Every item of the
# issue's list: the model answers each with a 400 whose message names the field as the client
# used it and says what is allowed.
BAD_HTTP = [
    # text_input: empty, missing, wrong shape, longer than the context, chat list
    ({"text_input": ""}, "text_input"),
    ({"max_tokens": 4}, "text_input"),
    ({"text_input": ["a", "b"]}, "text_input"),  # rejected by Triton itself (shape)
    ({"text_input": "hello " * 9000, "max_tokens": 4}, "text_input"),
    ({"text_input": "[1, 2]", "chat": True}, "text_input"),
    # prompt + max_tokens over the context; max_tokens 0, negative, huge
    ({"text_input": "hello " * 4000, "max_tokens": 5000}, "max_tokens"),
    ({"text_input": "x", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "x", "max_tokens": -5}, "max_tokens"),
    ({"text_input": "x", "max_tokens": 1_000_000}, "max_tokens"),
    ({"text_input": "x", "max_tokens": 2**31 - 1}, "max_tokens"),
    ({"text_input": "x", "sampling_parameters": _sp(max_tokens=10**12)}, "max_tokens"),
    ({"text_input": "x", "max_tokens": 4, "min_tokens": 9}, "min_tokens"),
    # temperature negative / NaN / inf (JSON NaN and Infinity literals are accepted by Triton)
    ({"text_input": "x", "temperature": -1.0}, "temperature"),
    ({"text_input": "x", "temperature": float("nan")}, "temperature"),
    ({"text_input": "x", "temperature": float("inf")}, "temperature"),
    ({"text_input": "x", "parameters": {"temperature": -0.5}}, "temperature"),
    ({"text_input": "x", "sampling_parameters": '{"temperature": NaN}'},
     "sampling_parameters.temperature"),
    ({"text_input": "x", "sampling_parameters": '{"temperature": -Infinity}'},
     "sampling_parameters.temperature"),
    ({"text_input": "x", "sampling_parameters": _sp(temperature="inf")},
     "sampling_parameters.temperature"),
    # top_p <= 0 or > 1; top_k negative; min_p out of range
    ({"text_input": "x", "parameters": {"top_p": 0}}, "top_p"),
    ({"text_input": "x", "top_p": -0.5}, "top_p"),
    ({"text_input": "x", "top_p": 1.5}, "top_p"),
    ({"text_input": "x", "top_k": -3}, "top_k"),
    ({"text_input": "x", "sampling_parameters": _sp(top_k=-2)}, "sampling_parameters.top_k"),
    ({"text_input": "x", "min_p": -0.1}, "min_p"),
    ({"text_input": "x", "min_p": 1.5}, "min_p"),
    # penalties out of range
    ({"text_input": "x", "repetition_penalty": 0.0}, "repetition_penalty"),
    ({"text_input": "x", "repetition_penalty": 11.0}, "repetition_penalty"),
    ({"text_input": "x", "parameters": {"presence_penalty": 9.5}}, "presence_penalty"),
    ({"text_input": "x", "presence_penalty": -2.5}, "presence_penalty"),
    ({"text_input": "x", "frequency_penalty": -3.0}, "frequency_penalty"),
    ({"text_input": "x", "sampling_parameters": _sp(frequency_penalty=2.5)},
     "sampling_parameters.frequency_penalty"),
    # seed out of range: any int64 or uint64 is a seed (vLLM's clients send -1; the tensor is
    # UINT64), so only values beyond both fit in JSON alone
    ({"text_input": "x", "sampling_parameters": _sp(seed=-2**63 - 1)}, "sampling_parameters.seed"),
    ({"text_input": "x", "sampling_parameters": _sp(seed=2**64)}, "sampling_parameters.seed"),
    ({"text_input": "x", "sampling_parameters": _sp(random_seed=1.5)},
     "sampling_parameters.random_seed"),
    # stop_words: thousands of entries, too long, not a list
    ({"text_input": "x", "stop_words": ["a"] * 3000}, "stop_words"),
    ({"text_input": "x", "sampling_parameters": _sp(stop=[f"s{i}" for i in range(1000)])},
     "sampling_parameters.stop"),
    ({"text_input": "x", "stop_words": ["y" * 1000]}, "stop_words"),
    ({"text_input": "x", "sampling_parameters": _sp(stop=5)}, "sampling_parameters.stop"),
    # sampling_parameters malformed or wrong-typed
    ({"text_input": "x", "sampling_parameters": "{not json"}, "sampling_parameters"),
    ({"text_input": "x", "sampling_parameters": "[1, 2]"}, "sampling_parameters"),
    ({"text_input": "x", "sampling_parameters": '"a string"'}, "sampling_parameters"),
    ({"text_input": "x", "sampling_parameters": '{"temprature": 0}'}, "sampling_parameters"),
    ({"text_input": "x", "sampling_parameters": _sp(max_tokens="abc")},
     "sampling_parameters.max_tokens"),
    ({"text_input": "x", "sampling_parameters": _sp(max_tokens=[4])},
     "sampling_parameters.max_tokens"),
    ({"text_input": "x", "sampling_parameters": _sp(ignore_eos="maybe")},
     "sampling_parameters.ignore_eos"),
    ({"text_input": "x", "sampling_parameters": _sp(temperature={})},
     "sampling_parameters.temperature"),
    # others
    ({"text_input": "x", "beam_width": 2}, "beam_width"),
    ({"text_input": "x", "sampling_parameters": _sp(n=0)}, "sampling_parameters.n"),
    ({"text_input": "x", "sampling_parameters": _sp(n=17)}, "sampling_parameters.n"),
    ({"text_input": "x", "sampling_parameters": _sp(best_of=2)}, "sampling_parameters.best_of"),
]
# Wrong JSON types for a tensor input: Triton's HTTP generate conversion refuses them before the
# model sees the request, with its own wording (which does not name the field; see
# model_repository/README.md, Errors).
TRITON_HTTP = [
    ({"text_input": 5}, "Unable to parse JSON bytes array"),
    ({"text_input": "x", "sampling_parameters": 5}, "Unable to parse JSON bytes array"),
    ({"text_input": "x", "max_tokens": "abc"}, "Unable to parse 'data'"),
    ({"text_input": "x", "temperature": "nan"}, "Unable to parse 'data'"),
    ({"text_input": "x", "seed": -1}, "Unable to parse 'data'"),
    ({"text_input": "x", "parameters": {"seed": -1}}, "Converting keyword: 'parameters'"),
    ({"text_input": "x", "parameters": {"ignore_eos": "perhaps"}},
     "Converting keyword: 'parameters'"),
]
# Accepted as documented: unknown request parameters / generate keys are ignored, empty stop
# strings are ignored (TensorRT-LLM pads stop_words with ""). They must give the greedy text.
IGNORED_HTTP = [
    {"parameters": {"no_such_parameter": 1}},
    {"no_such_key": "x"},
    {"stop_words": ["", ""]},
    {"sampling_parameters": _sp(stop=[""])},
]
INPUTS = {  # config.pbtxt: name -> (datatype, a valid value)
    "text_input": ("BYTES", b"x"), "sampling_parameters": ("BYTES", b"{}"),
    "max_tokens": ("INT32", 2), "min_tokens": ("INT32", 0), "min_length": ("INT32", 0),
    "stream": ("BOOL", True), "temperature": ("FP32", 0.0), "top_k": ("INT32", 0),
    "top_p": ("FP32", 1.0), "min_p": ("FP32", 0.0), "repetition_penalty": ("FP32", 1.0),
    "presence_penalty": ("FP32", 0.0), "frequency_penalty": ("FP32", 0.0),
    "seed": ("UINT64", 1), "random_seed": ("UINT64", 1), "stop_words": ("BYTES", b"x"),
    "ignore_eos": ("BOOL", False), "exclude_input_in_output": ("BOOL", True),
    "chat": ("BOOL", False), "beam_width": ("INT32", 1), "return_finish_reason": ("BOOL", True),
    "return_num_input_tokens": ("BOOL", True), "return_num_output_tokens": ("BOOL", True),
    "return_cumulative_logprob": ("BOOL", True), "return_logprobs": ("BOOL", True),
}
NP = {"BYTES": object, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64,
      "BOOL": np.bool_, "INT64": np.int64}
WRONG_DTYPE = {"BYTES": "INT32", "INT32": "FP32", "FP32": "INT32", "UINT64": "INT64",
               "BOOL": "INT32"}


def _tensor(name, datatype, values, shape=None):
    import tritonclient.grpc as grpcclient
    arr = np.array(values, dtype=NP[datatype])
    if shape is not None:
        arr = arr.reshape(shape)
    t = grpcclient.InferInput(name, list(arr.shape), datatype)
    t.set_data_from_numpy(arr)
    return t


def grpc_bad_cases():
    """(inputs, the text the error must contain): wrong dtype and wrong shape of every input,
    non-UTF-8 bytes, NaN/inf tensors, an input the model does not have."""
    cases = []
    for name, (dt, good) in INPUTS.items():
        base = [] if name == "text_input" else [_tensor("text_input", "BYTES", [b"x"])]
        wrong = WRONG_DTYPE[dt]
        cases.append((base + [_tensor(name, wrong, [0 if wrong != "FP32" else 0.5])], f"'{name}'"))
        shape = [1, 1] if name == "stop_words" else [2]
        cases.append((base + [_tensor(name, dt, [good] * (1 if shape == [1, 1] else 2), shape)],
                      f"'{name}'"))
    for name in ("text_input", "stop_words", "sampling_parameters"):
        base = [] if name == "text_input" else [_tensor("text_input", "BYTES", [b"x"])]
        cases.append((base + [_tensor(name, "BYTES", [b"\xff\xfe"])], f"{name}: not valid UTF-8"))
    for v in (float("nan"), float("inf"), -float("inf")):
        cases.append(([_tensor("text_input", "BYTES", [b"x"]),
                       _tensor("temperature", "FP32", [v])], "temperature: must be"))
    cases.append(([_tensor("text_input", "BYTES", [b"x"]), _tensor("no_such_input", "INT32", [1])],
                  "'no_such_input'"))
    return cases


def _http_post(server, body: bytes | dict, path="/v2/models/llm/generate"):
    conn = http.client.HTTPConnection("localhost", server.http_port, timeout=120)
    conn.request("POST", path, body if isinstance(body, bytes) else json.dumps(body))
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw)


STREAM_PROMPTS = [f"Write a long letter to friend number {i}:" for i in range(8)]


def test_bad_inputs_get_field_errors_while_8_streams_run(server, greedy):
    import tritonclient.grpc as grpcclient
    wants = greedy.many(STREAM_PROMPTS, 64, ignore_eos=True)
    server.wait_metric("llm_num_requests_running", lambda v: v == 0, timeout=60)
    results: list = [None] * 8

    def stream(i):
        try:
            results[i] = generate({"text_input": STREAM_PROMPTS[i], "max_tokens": 64,
                                   "ignore_eos": True, "temperature": 0.0, "stream": True},
                                  "grpc", server.grpc_url)["text"]
        except Exception as e:  # reported by the comparison below
            results[i] = e
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert server.wait_metric("llm_num_requests_running", lambda v: v == 8, timeout=60) == 8
    invalid0 = server.metric("llm_requests_total", default=0.0, finish_reason="invalid")
    failures = []
    for fields, field in BAD_HTTP:
        status, body = _http_post(server, fields)
        if not (status == 400 and field in body.get("error", "")):
            failures.append((str(fields)[:120], status, body))
    # non-UTF-8 bytes in the JSON body
    status, body = _http_post(server, b'{"text_input": "\xff\xfe abc", "max_tokens": 2}')
    if not (status == 400 and body.get("error", "").startswith("text_input: not valid UTF-8")):
        failures.append(("non-UTF-8", status, body))
    # a 10 MB prompt is refused at once (not tokenized whole in the request path)
    t0 = time.monotonic()
    status, body = _http_post(server, {"text_input": "hello world " * 900_000, "max_tokens": 2})
    huge_s = time.monotonic() - t0
    if not (status == 400 and body.get("error", "").startswith("text_input: the prompt is longer")):
        failures.append(("10 MB prompt", status, body))
    for fields, wording in TRITON_HTTP:
        status, body = _http_post(server, fields)
        if not (status in (400, 500) and wording in body.get("error", "")):
            failures.append((str(fields), status, body))
    # gRPC: wrong dtype/shape of every input, non-UTF-8, NaN/inf tensors, unknown input
    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        for inputs, wording in grpc_bad_cases():
            client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
            result, error = q.get(timeout=60)
            if error is None or wording not in error.message():
                failures.append(([i.name() for i in inputs], wording,
                                 error.message() if error else result.get_response()))
    finally:
        client.stop_stream()
        client.close()
    assert not failures, "\n".join(repr(f)[:300] for f in failures)
    # gRPC, streaming: the error arrives on the stream
    with pytest.raises(ServerError, match="^.*temperature: must be"):
        generate({"text_input": "x", "temperature": -2.0, "stream": True}, "grpc", server.grpc_url)
    running = server.metric("llm_num_requests_running")
    for t in threads:
        t.join(180)
    assert results == wants
    assert running > 0, "the 8 streams finished before the bad requests did: lengthen them"
    # documented as ignored: a normal answer
    want = greedy("x", 2)
    for extra in IGNORED_HTTP:
        status, body = _http_post(server, {"text_input": "x", "max_tokens": 2, "temperature": 0.0,
                                           "exclude_input_in_output": True, **extra})
        assert status == 200 and body["text_output"] == want, (extra, body)
    assert server.ready()
    # all but the two shape/presence errors of text_input reached the model and were counted
    n_model = len(BAD_HTTP) - 2 + 2 + 1 + 3 + 3  # + HTTP UTF-8 and 10 MB, stream, gRPC UTF-8, NaN
    assert server.metric("llm_requests_total", finish_reason="invalid") >= invalid0 + n_model
    assert huge_s < 10, f"the 10 MB prompt took {huge_s:.1f}s to refuse"
    assert server.wait_metric(KV, lambda v: v == 0) == 0
