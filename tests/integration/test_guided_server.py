"""Structured output through the real tritonserver: streamed deltas (gRPC streaming, HTTP
generate_stream) concatenate to output that parses; every bad constraint gets an error naming its
field while a stream runs, and that stream is unharmed."""
from __future__ import annotations

import http.client
import json
import re
import threading

import jsonschema
import pytest

from client.generate import ServerError, generate

pytestmark = pytest.mark.integration

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}
PROMPT = "Reply with JSON only: a person with a name, an age and tags."


def test_grpc_stream_guided_json_deltas_parse(server):
    sp = {"guided_json": SCHEMA, "temperature": 0, "max_tokens": 96}
    out = generate({"text_input": PROMPT, "stream": True, "sampling_parameters": json.dumps(sp)},
                   "grpc", server.grpc_url)
    assert out["finish_reason"] == "stop" and out["responses"] > 3  # really streamed
    jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_http_generate_stream_request_parameters(server):
    cases = [({"guided_json": json.dumps(SCHEMA)},
              lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
             ({"guided_regex": r"[0-9]{3}-[0-9]{4}"},
              lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) or pytest.fail(t)),
             ({"guided_choice": '["yes", "no"]'}, lambda t: t in ("yes", "no") or pytest.fail(t)),
             ({"response_format": '{"type": "json_object"}'},
              lambda t: isinstance(json.loads(t), dict) or pytest.fail(t))]
    for params, check in cases:
        out = generate({"text_input": PROMPT, "stream": True, "max_tokens": 96, "seed": 5,
                        "temperature": 0.7, "parameters": params}, "http", server.http_url)
        assert out["finish_reason"] == "stop", (params, out)
        check(out["text"])


def _http(server, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("localhost", server.http_port, timeout=120)
    conn.request("POST", "/v2/models/llm/generate", json.dumps(body))
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw)


def _sp(**kw) -> str:
    return json.dumps(kw)


# (HTTP generate body, the start of its error message). Validation errors name the field as the
# client sent it; compile errors (the request entered the engine) name the engine's field.
BAD = [
    ({"sampling_parameters": _sp(guided_json="{not json")}, "sampling_parameters.guided_json:"),
    ({"sampling_parameters": _sp(guided_json={"type": "foo"})}, "guided_json: cannot be compiled"),
    ({"parameters": {"guided_json": "[1, 2]"}}, "guided_json: must be a JSON schema object"),
    ({"sampling_parameters": _sp(guided_regex="(ab")}, "guided_regex: cannot be compiled"),
    ({"parameters": {"guided_regex": ""}}, "guided_regex: must not be empty"),
    ({"sampling_parameters": _sp(guided_choice=[])}, "sampling_parameters.guided_choice: must not"),
    ({"parameters": {"guided_choice": "[]"}}, "guided_choice: must not be empty"),
    ({"sampling_parameters": _sp(guided_regex="a", guided_choice=["a"])},
     "sampling_parameters.guided_choice: only one of"),
    ({"sampling_parameters": _sp(guided_grammar="root ::= nothing_here")},
     "guided_grammar: cannot be compiled"),
    ({"sampling_parameters": _sp(response_format={"type": "xml"})},
     "sampling_parameters.response_format:"),
]


def test_bad_constraints_get_field_errors_while_a_stream_runs(server):
    fields = {"text_input": "Write a story about a cat:", "max_tokens": 48, "ignore_eos": True,
              "temperature": 0.0, "stream": True}
    want = generate(fields, "grpc", server.grpc_url)["text"]
    result: list = []
    t = threading.Thread(target=lambda: result.append(generate(fields, "grpc", server.grpc_url)))
    t.start()
    failures = []
    for body, msg in BAD:
        status, resp = _http(server, {"text_input": "Hi", "max_tokens": 8, **body})
        if not (status == 400 and resp.get("error", "").startswith(msg)):
            failures.append((body, status, resp))
    # gRPC streaming: the compile error arrives on the stream, before any text
    with pytest.raises(ServerError, match="guided_regex: cannot be compiled"):
        generate({"text_input": "Hi", "max_tokens": 8, "stream": True,
                  "sampling_parameters": _sp(guided_regex="(ab")}, "grpc", server.grpc_url)
    t.join(300)
    assert not failures, failures
    assert result and result[0]["text"] == want  # the running stream was unharmed
    assert server.ready()
