"""Fuzz the Triton request parser (backend/triton/request.py) without a server: whatever the
client sends, parse_request either returns a request whose SamplingParams validate or raises a
ValueError whose message starts with a field name the client used. Besides small values, every
JSON-bearing input is drawn hostile too: nested thousands of levels deep (json.loads would raise
RecursionError), megabytes long, or a long list."""
from __future__ import annotations

import json
import math

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from backend.engine.json_input import MAX_JSON_DEPTH
from backend.triton.request import (ALL_INPUTS, FIELDS, ParsedRequest, check_prompt_size,
                                    parse_request)
from client.generate import DTYPES

NAMES = sorted(set(FIELDS) | {"text_input", "sampling_parameters", "unknown_field"})
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["true", "false", "1", "0", "16", "16.0", "0.5", "nan", "inf", "-1", "[1]",
                     '["a", ""]', "{}", "1e400", " 3 "]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(NAMES), inner, max_size=3)),
    max_leaves=8)


# the dtype Triton enforces for each input (config.pbtxt): the model only ever sees these
DTYPE = {name: {"BYTES": object, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64,
                "BOOL": np.bool_}[dt] for name, dt in DTYPES.items()}


@st.composite
def tensor_for(draw, name):
    """The tensor of input `name` as the Python backend hands it over: Triton has checked dtype
    and shape ([1], stop_words [-1]); sometimes something else, as a direct caller might pass."""
    dtype = DTYPE[name] if draw(st.integers(0, 9)) else draw(st.sampled_from(
        [object, np.int32, np.int64, np.float32, np.bool_, np.uint64]))
    n = draw(st.integers(0, 4)) if name == "stop_words" else (1 if draw(st.integers(0, 9)) else 2)
    if dtype is object:
        items = draw(st.lists(st.one_of(
            st.text(max_size=8).map(lambda s: s.encode("utf-8")), st.binary(max_size=6),
            st.sampled_from([b"", b"\xff\xfe", b"16", b"true", b"nan"])), min_size=n, max_size=n))
        return np.array(items, dtype=object)
    if dtype is np.bool_:
        return np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.bool_)
    if dtype is np.float32:
        return np.array(draw(st.lists(st.floats(width=32), min_size=n, max_size=n)), np.float32)
    lo, hi = (0, 2**64 - 1) if dtype is np.uint64 else (-2**31, 2**31 - 1)
    vals = draw(st.lists(st.one_of(st.integers(lo, hi), st.integers(max(lo, -3), 40)),
                         min_size=n, max_size=n))
    return np.array(vals, dtype=dtype)


@st.composite
def requests(draw):
    names = draw(st.lists(st.sampled_from(sorted(set(ALL_INPUTS) - {"text_input",
                                                                     "sampling_parameters"})),
                          max_size=6, unique=True))
    inputs = {name: draw(tensor_for(name)) for name in names}
    if draw(st.integers(0, 9)):
        inputs["text_input"] = np.array([draw(st.text(max_size=20)).encode()], dtype=object)
    elif draw(st.booleans()):
        inputs["text_input"] = draw(tensor_for("text_input"))
    if draw(st.integers(0, 3)) == 0:
        sp = draw(st.one_of(st.dictionaries(st.sampled_from(NAMES), json_values, max_size=4)
                            .map(json.dumps), st.text(max_size=20)))
        inputs["sampling_parameters"] = np.array([sp.encode()], dtype=object)
    params = draw(st.one_of(st.none(), st.dictionaries(st.sampled_from(NAMES), scalars,
                                                       max_size=3)))
    if params is not None and draw(st.booleans()):
        params = json.dumps(params)  # request.parameters() gives the JSON text
    return inputs, params


def check_answer(inputs, params) -> ParsedRequest | str:
    """parse_request's answer: a request that validates, or a ValueError naming a client field
    (any other exception, RecursionError included, fails the test): the request or the message."""
    try:
        parsed = parse_request(inputs, params)
    except ValueError as e:
        msg = str(e)
        field = msg.split(":", 1)[0]
        base = field.removeprefix("sampling_parameters.")
        assert ":" in msg and (base in FIELDS or field in ("text_input", "sampling_parameters",
                                                           "parameters")), msg
        return msg
    parsed.params.validate()
    assert isinstance(parsed.prompt, str)
    return parsed


@settings(max_examples=600, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(requests())
def test_parse_request_returns_or_names_the_field(req):
    parsed = check_answer(*req)
    if isinstance(parsed, str):
        return
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        assert math.isfinite(getattr(parsed.params, name))


# ---- hostile JSON in every JSON-bearing input ----------------------------------------------------
JSON_FIELDS = ("stop", "stop_token_ids", "guided_json", "guided_choice", "response_format",
               "guided_regex", "max_tokens", "logprobs", "unknown_field")


def nested(levels: int, kind: str, closed: bool) -> str:
    opener, closer = ("[", "]") if kind == "list" else ('{"type": ', "}")
    return opener * levels + ('"x"' + closer * levels if closed else "")


hostile_json = st.one_of(
    st.builds(nested, st.integers(5_000, 20_000), st.sampled_from(["list", "object"]),
              st.booleans()),  # deep: json.loads raises RecursionError past ~1,000
    st.builds(nested, st.integers(MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH + 1),
              st.sampled_from(["list", "object"]), st.just(True)),  # at the limit
    st.sampled_from([10_000, 1 << 20, 5 << 20]).map(lambda n: json.dumps("ab" * (n // 2))),
    st.sampled_from([10_000, 1 << 20, 3 << 20]).map(lambda n: "[" + "7," * (n - 1) + "7]"),
    st.sampled_from(['"' + '\\"' * 100_000, "[" * 70 + '"' + "]" * 70, "9" * 5_000]))


def deep_object(levels: int):
    """A parsed value that deep, as a direct caller may hand over (built without recursion)."""
    v: object = "x"
    for i in range(levels):
        v = [v] if i % 2 else {"type": v}
    return v


@st.composite
def hostile_requests(draw):
    """(inputs, parameters, depth of the hostile value): one JSON-bearing input hostile."""
    payload = draw(hostile_json)
    depth = payload.count("[") + payload.count("{") if payload[:1] in "[{" else 0
    field = draw(st.sampled_from(JSON_FIELDS))
    inputs = {"text_input": np.array([b"hello"], dtype=object)}
    params: dict | str | None = None
    where = draw(st.sampled_from(["sampling_parameters", "sampling_parameters.field",
                                  "sampling_parameters.field as text", "chat", "parameters",
                                  "parameters.field as text", "parameters.field as object"]))
    if where == "sampling_parameters":
        inputs["sampling_parameters"] = np.array([payload.encode()], dtype=object)
    elif where == "sampling_parameters.field":
        text = '{"%s": %s}' % (field, payload)
        inputs["sampling_parameters"] = np.array([text.encode()], dtype=object)
    elif where == "sampling_parameters.field as text":  # JSON text inside a JSON string
        inputs["sampling_parameters"] = np.array([json.dumps({field: payload}).encode()], object)
    elif where == "chat":
        inputs["text_input"] = np.array([payload.encode()], dtype=object)
        inputs["chat"] = np.array([True])
        depth = depth if payload.startswith("[") else 0  # else one plain user message
    elif where == "parameters":
        params = '{"%s": %s}' % (field, payload)
    elif where == "parameters.field as text":
        params = {field: payload}
    else:
        depth = draw(st.sampled_from([MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 5_000]))
        params = {field: depth}  # the test builds it (hypothesis prints examples recursively)
    return inputs, params, depth, where, field


@settings(max_examples=250, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile_requests())
def test_hostile_json_in_any_input_is_a_named_error(req):
    inputs, params, depth, where, field = req
    if where == "parameters.field as object":
        params = {field: deep_object(depth)}
    answer = check_answer(inputs, params)
    event(f"{where}, {'deep' if depth > MAX_JSON_DEPTH else 'shallow'}: "
          f"{'refused' if isinstance(answer, str) else 'accepted'}")
    # A value nested past the limit is refused wherever it is parsed as JSON. Not parsed: an
    # unknown request parameter (Triton shares them with other backends), a regex.
    ignored = (where.startswith("parameters") and field == "unknown_field") or (
        field == "guided_regex" and where.endswith("as text"))
    if depth > MAX_JSON_DEPTH + 2 and not ignored:
        assert isinstance(answer, str), (where, field, depth)


class _CharTokenizer:
    """One token per character: the worst case for the prefix check (no false rejections)."""

    def encode(self, text):
        return list(range(len(text)))


class _WordTokenizer:
    def encode(self, text):
        return text.split()


def test_check_prompt_size_rejects_huge_prompts_from_a_prefix():
    import pytest
    huge = "hello world " * 900_000  # ~10 MB
    with pytest.raises(ValueError, match=r"^text_input: the prompt is longer than the context"):
        check_prompt_size(_WordTokenizer(), huge, 8192)
    check_prompt_size(_WordTokenizer(), "hello " * 8000, 8192)  # short enough: the engine decides
    # a prefix that does not prove the prompt too long is left to the engine's exact count
    check_prompt_size(_WordTokenizer(), "x" * 200_000, 8192)
    check_prompt_size(None, huge, 8192)
    with pytest.raises(ValueError):
        check_prompt_size(_CharTokenizer(), "y" * 100_000, 8192)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(json_values, st.fixed_dictionaries(
    {"input": st.one_of(st.text(max_size=8), st.lists(st.integers(-3, 2**40), max_size=3),
                        json_values)},
    optional={"pooling_params": st.one_of(json_values, st.fixed_dictionaries(
        {"dimensions": st.one_of(json_values, st.lists(json_values, max_size=2))}))})))
def test_embedding_request_parses_or_names_the_field(body):
    from backend.triton.embedding_request import EmbeddingInput, parse_embedding_request
    try:
        got = parse_embedding_request(json.dumps(body))
    except ValueError as e:
        assert str(e).startswith("embedding_request"), e
        return
    assert isinstance(got, EmbeddingInput)
    assert isinstance(got.input, (str, list)) and got.input
    assert got.dimensions is None or (isinstance(got.dimensions, int)
                                      and not isinstance(got.dimensions, bool))
