"""Fuzz the request path of the real server (HTTP generate, a few hundred derandomized cases, JSON
inputs drawn hostile too): every answer is a valid result or an error with a message (the model's
naming the field, or Triton's own for what it refuses before the model); the server stays READY
and still gives the offline greedy text afterwards. Then hostile JSON between good requests."""
from __future__ import annotations

import collections
import http.client
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.triton.request import FIELDS
from client.generate import generate

pytestmark = pytest.mark.integration
MAX_NEW = 4
# Triton's own refusals (HTTP generate JSON conversion, shapes, one response per generate)
TRITON_WORDING = ("Unable to parse", "Converting keyword", "The schema can not convert",
                  "generate expects model to produce exactly 1 response", "unexpected shape",
                  "data-type is", "expected", "Expected JSON object", "invalid type")
KNOWN = set(FIELDS) | {"text_input", "sampling_parameters", "chat"}

weird = st.one_of(st.none(), st.booleans(), st.text(max_size=6), st.lists(st.integers(-3, 9),
                                                                           max_size=2),
                  st.dictionaries(st.sampled_from(["a", "max_tokens"]), st.integers(), max_size=1))
floats_ok = st.one_of(st.floats(-3, 3), st.sampled_from([0.0, 1.0, -1.0, 1.5, 1e9, math.nan,
                                                          math.inf, -math.inf]))
ints_ok = st.one_of(st.integers(-3, 70), st.sampled_from([2**31 - 1, -2**31]))
bools_ok = st.booleans()
scalar_ok = st.one_of(st.integers(-5, 5), st.text(max_size=5), st.booleans())  # any parameter


def mostly(ok, p_weird=8):
    """Values of the input's JSON type, one in `p_weird` of another type (Triton refuses those)."""
    return st.integers(0, p_weird - 1).flatmap(lambda i: weird if i == 0 else ok)


floats, ints = mostly(floats_ok), mostly(ints_ok)
VALUES = {
    "temperature": floats, "top_p": floats, "min_p": floats, "repetition_penalty": floats,
    "presence_penalty": floats, "frequency_penalty": floats, "top_k": ints, "seed": ints,
    "random_seed": st.one_of(ints, st.sampled_from([2**64 - 1, 2**64, -1])),
    "min_tokens": st.one_of(st.integers(0, 6), ints),
    "stop_words": mostly(st.lists(st.text(max_size=4), max_size=70)),
    "ignore_eos": mostly(bools_ok), "beam_width": st.one_of(st.just(1), ints),
    "exclude_input_in_output": mostly(bools_ok), "return_finish_reason": mostly(bools_ok),
    "return_num_output_tokens": mostly(bools_ok), "return_cumulative_logprob": mostly(bools_ok),
    "chat": mostly(st.sampled_from([False, False, True])),
    "stream": st.one_of(st.just(False), st.just(False), st.booleans()),
}
max_tokens = st.integers(0, 9).flatmap(lambda i: st.integers(1, MAX_NEW) if i < 7 else (
    st.sampled_from([0, -1, 2**31 - 1, 10**6, [2]]) if i < 9 else
    st.sampled_from(["3", 2.5, None, True])))


# JSON text in a string input, as a hostile client sends it: thousands of levels deep (json.loads
# alone raises RecursionError), or long strings and lists.
hostile_json = st.one_of(
    st.integers(5_000, 20_000).map(lambda n: "[" * n + "]" * n),
    st.integers(5_000, 20_000).map(lambda n: '{"stop": ' + "[" * n),
    st.integers(5_000, 20_000).map(lambda n: json.dumps({"guided_json": '{"a": ' * n})),
    st.sampled_from([10_000, 300_000]).map(lambda n: json.dumps({"stop": ["ab" * n]})),
    st.sampled_from([10_000, 300_000]).map(lambda n: json.dumps({"stop": ["ab"] * n})))


@st.composite
def bodies(draw):
    body: dict = {"max_tokens": draw(max_tokens)}
    kind = draw(st.integers(0, 19))
    if kind < 16:
        body["text_input"] = draw(st.text(min_size=0 if kind == 0 else 1, max_size=40))
    elif kind < 17:
        body["text_input"] = draw(weird)
    elif kind < 18:  # chat messages as JSON text
        body["text_input"], body["chat"] = draw(hostile_json), True
    for name in draw(st.lists(st.sampled_from(sorted(VALUES)), max_size=4, unique=True)):
        body[name] = draw(VALUES[name])
    if draw(st.integers(0, 4)) == 0:
        names = draw(st.lists(st.sampled_from(sorted(VALUES)), max_size=3, unique=True))
        body["parameters"] = {n: draw(VALUES[n]) for n in names}
        if draw(st.booleans()):
            body["parameters"]["no_such_parameter"] = draw(mostly(scalar_ok))
    if draw(st.integers(0, 4)) == 0:
        names = draw(st.lists(st.sampled_from(sorted(VALUES) + ["max_tokens", "stop", "bogus"]),
                              max_size=3, unique=True))
        sp = {n: draw(VALUES.get(n, ints)) for n in names if n != "max_tokens"}
        body["sampling_parameters"] = draw(st.one_of(
            st.just(json.dumps(sp)), st.text(max_size=12), weird, hostile_json))
    if draw(st.integers(0, 9)) == 0:
        body["no_such_key"] = draw(mostly(scalar_ok))
    return body


def _post(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("localhost", port, timeout=120)
    conn.request("POST", "/v2/models/llm/generate", json.dumps(body))  # NaN/Infinity literals too
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw)


def classify(status: int, body: dict) -> str:
    """'valid', 'model_error' or 'triton_error'; AssertionError for anything else."""
    if "error" not in body:
        assert status == 200 and isinstance(body.get("text_output"), str), (status, body)
        n = body.get("num_output_tokens")
        assert n is None or 0 <= n <= MAX_NEW, body
        return "valid"
    msg = body["error"]
    assert isinstance(msg, str) and msg, body
    field = msg.split(":", 1)[0].removeprefix("sampling_parameters.")
    if status == 400 and ":" in msg and field in KNOWN:
        return "model_error"
    assert status in (200, 400, 500) and any(w in msg for w in TRITON_WORDING), (status, msg)
    return "triton_error"


def test_fuzz_http_generate(server, greedy):
    seen: collections.Counter = collections.Counter()
    messages: collections.Counter = collections.Counter()  # Triton's refusals, for the log

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies())
    def one(body):
        status, answer = _post(server.http_port, body)
        kind = classify(status, answer)
        seen[kind] += 1
        if kind == "triton_error":
            messages[answer["error"][:70]] += 1
    one()
    print(dict(seen), messages.most_common(8))
    assert seen["valid"] >= 50 and seen["model_error"] >= 30, seen  # both paths exercised
    assert server.ready()
    prompt = "The capital of France is"
    assert generate({"text_input": prompt, "max_tokens": 12, "temperature": 0.0,
                     "stream": True}, "grpc", server.grpc_url)["text"] == greedy(prompt, 12)
    assert server.wait_metric("llm_kv_cache_blocks_used", lambda v: v == 0, timeout=30) == 0


def _deep(levels: int, opener: str = "[", closer: str = "]", leaf: str = "") -> str:
    return opener * levels + leaf + closer * levels


# Requests that made execute() raise or were accepted unchecked (issue 54), and their kin: each
# must be answered with an error naming its field while good requests around it are served.
HOSTILE = [
    ({"sampling_parameters": '{"stop": ' + _deep(10_000) + "}"},
     "sampling_parameters: nested deeper than 64"),
    ({"text_input": _deep(10_000), "chat": True},
     "text_input: chat messages: nested deeper than 64"),
    ({"sampling_parameters": json.dumps({"logprobs": 1_000_000})},
     "sampling_parameters.logprobs: must be in [0, 20], got 1000000"),
    ({"sampling_parameters": json.dumps({"guided_json": _deep(5_000, '{"a": ', "}", "1")})},
     "sampling_parameters.guided_json: nested deeper than 64"),
    ({"sampling_parameters": json.dumps({"response_format": '{"type": "json_schema", '
                                         '"json_schema": {"schema": ' + _deep(6_000) + "}}"})},
     "sampling_parameters.response_format: nested deeper than 64"),
    ({"sampling_parameters": json.dumps({"stop": ["ab" * (3 << 20)]})},
     "sampling_parameters: at most 4194304 characters of JSON"),
    ({"sampling_parameters": '{"max_tokens": ' + "9" * 5_000 + "}"},
     "sampling_parameters: not valid JSON (a number with too many digits)"),
]


def test_hostile_json_back_to_back_with_good_requests_on_one_stream(server, greedy):
    """Good, every hostile request, good on one gRPC stream (Triton calls execute() once per
    request here, in order): both good ones give the offline greedy text; each hostile one gets
    its own clear error, in order, and no Python internals."""
    import queue

    import tritonclient.grpc as grpcclient

    from client.generate import grpc_inputs
    prompts = ["The capital of France is", "Water boils at"]
    good = {"max_tokens": 8, "temperature": 0.0, "stream": True, "exclude_input_in_output": True}
    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer("llm", grpc_inputs({"text_input": prompts[0], **good}),
                                  request_id="good-0", enable_empty_final_response=True)
        for i, (fields, _) in enumerate(HOSTILE):
            client.async_stream_infer("llm", grpc_inputs({"text_input": "hi", "max_tokens": 4,
                                                          **fields}),
                                      request_id=f"bad-{i}", enable_empty_final_response=True)
        client.async_stream_infer("llm", grpc_inputs({"text_input": prompts[1], **good}),
                                  request_id="good-1", enable_empty_final_response=True)
        texts, finished, errors = {"good-0": "", "good-1": ""}, set(), []
        while len(finished) < 2 or len(errors) < len(HOSTILE):
            result, error = q.get(timeout=300)
            if error is not None:  # a stream error carries no request id: they come in order
                errors.append(error.message())
                continue
            resp = result.get_response()
            assert resp.id in texts, resp.id  # a hostile request never gets a result
            if resp.outputs:
                texts[resp.id] += result.as_numpy("text_output").reshape(-1)[0].decode()
            if resp.parameters["triton_final_response"].bool_param:
                finished.add(resp.id)
    finally:
        client.stop_stream()
        client.close()
    assert [texts["good-0"], texts["good-1"]] == greedy.many(prompts, 8)
    for message, (_, expected) in zip(errors, HOSTILE):
        assert expected in message, (expected, message[:300])
        for leak in ("RecursionError", "Exception", "Traceback", "recursion", "sys."):
            assert leak not in message, message[:300]
    assert server.ready()
    assert server.wait_metric("llm_kv_cache_blocks_used", lambda v: v == 0, timeout=30) == 0


def test_hostile_json_over_http_generate(server):
    """The same through HTTP generate (its JSON body carries sampling_parameters as a string):
    status 400, the error naming the field."""
    for fields, expected in HOSTILE[:4]:
        status, answer = _post(server.http_port, {"text_input": "hi", "max_tokens": 4, **fields})
        assert status == 400 and expected in answer.get("error", ""), (status, answer)
    status, answer = _post(server.http_port, {"text_input": "hi", "max_tokens": 4})
    assert status == 200 and isinstance(answer.get("text_output"), str), answer
