"""Fuzz the Triton request parser (backend/triton/request.py) without a server: whatever the
client sends, parse_request either returns a request whose SamplingParams validate or raises a
ValueError whose message starts with a field name the client used."""
from __future__ import annotations

import json
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.triton.request import ALL_INPUTS, FIELDS, check_prompt_size, parse_request
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


@settings(max_examples=600, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(requests())
def test_parse_request_returns_or_names_the_field(req):
    inputs, params = req
    try:
        parsed = parse_request(inputs, params)
    except ValueError as e:
        msg = str(e)
        field = msg.split(":", 1)[0]
        base = field.removeprefix("sampling_parameters.")
        assert ":" in msg and (base in FIELDS or field in ("text_input", "sampling_parameters")), msg
        return
    parsed.params.validate()
    assert isinstance(parsed.prompt, str)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        assert math.isfinite(getattr(parsed.params, name))


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
