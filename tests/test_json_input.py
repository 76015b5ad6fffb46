"""backend/engine/json_input.py: the depth of JSON text is measured without recursing, exactly for
valid JSON and never below what the parser would reach for any text; client JSON ends in a
ValueError naming the field, never in RecursionError; parsed objects are measured iteratively."""
from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.engine import json_input
from backend.engine.json_input import MAX_JSON_DEPTH, check_depth, json_depth, loads
from backend.engine.sampling.sampling_params import SamplingParams


def depth_of(v) -> int:
    if isinstance(v, dict):
        return 1 + max(map(depth_of, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(depth_of, v), default=0)
    return 0


tricky_text = st.text(alphabet='[]{}"\\/:, ab\n', max_size=12)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), tricky_text),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(tricky_text, inner, max_size=4)), max_leaves=40)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(json_values)
def test_depth_of_valid_json_is_exact(v):
    text = json.dumps(v, ensure_ascii=False)
    assert json_depth(text) == depth_of(v)
    assert json_depth(json.dumps(v, indent=1)) == depth_of(v)


@st.composite
def hostile_texts(draw):
    """Mostly-broken JSON: strings, escapes and brackets interleaved, sometimes a deep run."""
    parts = draw(st.lists(st.one_of(
        st.text(alphabet='[]{}"\\,: 1', max_size=30),
        st.integers(70, 3000).map(lambda n: "[" * n),
        st.integers(70, 3000).map(lambda n: '{"a":' * n),
        st.sampled_from(['"', '\\"', '"\\', '["', '"]', "[1,", '{"k":'])), max_size=8))
    return "".join(parts)


@settings(max_examples=600, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(hostile_texts())
def test_loads_never_recurses_too_deep(text):
    """Whatever the text, loads() returns a value no deeper than the limit or raises a
    ValueError naming the field; RecursionError (not a ValueError) would fail this test."""
    try:
        v = loads("field", text, max_depth=MAX_JSON_DEPTH)
    except ValueError as e:
        assert str(e).startswith("field: "), e
        return
    assert depth_of(v) <= MAX_JSON_DEPTH


@pytest.mark.parametrize("text", [
    "[" * 10_000 + "]" * 10_000, '{"a":' * 10_000 + "1" + "}" * 10_000, "[" * 100_000,
    '["' + '\\"' * 1000 + '"' + "[" * 5000])
def test_deep_text_is_refused_by_name(text):
    with pytest.raises(ValueError, match=r"^sampling_parameters: nested deeper than 64$"):
        loads("sampling_parameters", text)


def test_brackets_inside_strings_do_not_count():
    text = json.dumps({"stop": ["[" * 5000, "{" * 5000, '\\"[' * 100]})
    assert json_depth(text) == 2
    assert loads("x", text)["stop"][0] == "[" * 5000


def test_unterminated_strings_are_linear():
    """A pattern that fails at the end of the text would be retried from every later quote."""
    text = '"' + '\\"' * 1_000_000  # 2 MB, a million escaped quotes, never closed
    t0 = time.perf_counter()
    assert json_depth(text) == 0
    with pytest.raises(ValueError, match="^x: not valid JSON"):
        loads("x", text + "[" * 100)
    assert time.perf_counter() - t0 < 60  # quadratic would be hours; linear is well under 1 s


def test_size_limit_and_bad_bytes():
    with pytest.raises(ValueError, match=r"^x: at most 10 characters of JSON, got 11$"):
        loads("x", '"123456789"', max_chars=10)
    assert loads("x", b'{"a": 1}') == {"a": 1}
    with pytest.raises(ValueError, match=r"^x: not valid UTF-8$"):
        loads("x", b'"\xff"')
    with pytest.raises(ValueError, match=r"^x: not valid JSON \(a number with too many digits\)"):
        loads("x", "9" * 5000)


def test_check_depth_limit_is_the_same_as_for_text():
    for levels in (MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1):
        obj = json.loads("[" * levels + "]" * levels)
        ok_text = levels <= MAX_JSON_DEPTH
        try:
            check_depth("x", obj)
            ok_obj = True
        except ValueError as e:
            assert str(e) == f"x: nested deeper than {MAX_JSON_DEPTH}"
            ok_obj = False
        assert ok_obj == ok_text == (json_depth("[" * levels + "]" * levels) <= MAX_JSON_DEPTH)


def test_check_depth_cycles_and_shared_objects():
    cyc: dict = {}
    cyc["self"] = cyc
    with pytest.raises(ValueError, match="nested deeper"):
        check_depth("x", cyc)
    shared: list = [1]
    for _ in range(60):  # 2**60 paths, 61 distinct lists: each is walked once
        shared = [shared, shared, (shared,)]
    t0 = time.perf_counter()
    check_depth("x", shared, max_depth=200)
    with pytest.raises(ValueError):
        check_depth("x", [[shared]], max_depth=62)
    assert time.perf_counter() - t0 < 30


def test_guided_specs_refuse_deep_objects_and_text():
    deep = json.loads('{"type": "object", "properties": ' + '{"a": ' * 80 + "{}" + "}" * 80 + "}")
    with pytest.raises(ValueError, match=r"^guided_json: nested deeper than 64$"):
        SamplingParams(guided_json=deep)
    with pytest.raises(ValueError, match=r"^response_format: nested deeper than 64$"):
        SamplingParams(response_format={"type": "json_schema", "json_schema": {"schema": deep}})
    with pytest.raises(ValueError, match=r"^guided_json: nested deeper than 64$"):
        SamplingParams(guided_json="[" * 10_000)
    with pytest.raises(ValueError, match=r"^response_format: nested deeper than 64$"):
        SamplingParams(response_format='{"type": ' + "[" * 10_000)
    assert json_input.MAX_JSON_CHARS >= 1 << 20  # a schema of the largest size guided_spec allows
