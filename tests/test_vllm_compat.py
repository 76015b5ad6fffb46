"""vLLM-backend request fields as Triton's OpenAI frontend and vllm_backend clients send them:
stop strings, int64 seeds, structured_outputs / guided_decoding dicts, lora_name; and the vllm:*
metric families against a fake triton_python_backend_utils."""
import json

import numpy as np
import pytest

from backend.triton.request import parse_request
from backend.triton.vllm_compat import seed_value, structured_fields
from backend.triton.vllm_metrics import buckets_1_2_5

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# json.dumps(asdict(vllm.sampling_params.StructuredOutputsParams(json=schema_text))): what the
# frontend (>= 25.11) puts in sampling_parameters["structured_outputs"] for a named tool choice;
# asdict() also carries the init=False fields _backend / _backend_was_auto.
STRUCTURED_OUTPUTS = json.dumps({
    "json": json.dumps(SCHEMA), "regex": None, "choice": None, "grammar": None,
    "json_object": None, "disable_fallback": False, "disable_any_whitespace": False,
    "disable_additional_properties": False, "whitespace_pattern": None, "structural_tag": None,
    "_backend": None, "_backend_was_auto": False})
# asdict(GuidedDecodingParams.from_optional(json=...)): frontends 25.05-25.10
GUIDED_DECODING = json.dumps({
    "json": json.dumps(SCHEMA), "regex": None, "choice": None, "grammar": None,
    "json_object": None, "backend": None, "backend_was_auto": False, "disable_fallback": False,
    "disable_any_whitespace": False, "disable_additional_properties": False,
    "whitespace_pattern": None, "structural_tag": None})


def sp(d: dict) -> dict:
    return {"text_input": np.array([b"Hi"], dtype=object),
            "sampling_parameters": np.array([json.dumps(d).encode()], dtype=object)}


@pytest.mark.parametrize("stop", ["[END]", '["a"]', "{x}"])
def test_a_stop_string_is_one_stop_string(stop):
    assert parse_request(sp({"stop": stop})).params.stop == [stop]
    assert parse_request(sp({"stop": [stop, "\n"]})).params.stop == [stop, "\n"]


@pytest.mark.parametrize("seed, engine_seed", [
    (-1, 2**64 - 1), (-(2**63), 2**63), (0, 0), (42, 42), (2**64 - 1, 2**64 - 1)])
def test_any_int64_seed_maps_to_its_unsigned_bits(seed, engine_seed):
    assert parse_request(sp({"seed": seed})).params.seed == engine_seed
    assert seed_value("seed", seed) == engine_seed
    if seed < 0:  # the same 64 bits
        assert np.array([seed], np.int64).view(np.uint64)[0] == engine_seed


@pytest.mark.parametrize("key, text", [("structured_outputs", STRUCTURED_OUTPUTS),
                                       ("guided_decoding", GUIDED_DECODING)])
def test_frontend_structured_dicts_map_to_guided_json(key, text):
    """The frontend sends the dict as JSON text inside sampling_parameters; a client may send
    the dict itself."""
    for value in (text, json.loads(text)):
        p = parse_request(sp({"max_tokens": 32, key: value})).params
        assert p.guided_json == SCHEMA and p.guided is not None
        assert (p.guided_regex, p.guided_choice, p.guided_grammar, p.response_format) == \
            (None, None, None, None)


def test_each_structured_key_maps_to_ours():
    assert structured_fields("s", {"regex": "[ab]+", "backend": "xgrammar",
                                   "whitespace_pattern": " ", "disable_fallback": True}) == \
        {"guided_regex": "[ab]+"}
    assert structured_fields("s", {"choice": ["yes", "no"]}) == {"guided_choice": ["yes", "no"]}
    assert structured_fields("s", {"grammar": 'root ::= "a"'}) == {"guided_grammar": 'root ::= "a"'}
    assert structured_fields("s", {"json_object": True}) == \
        {"response_format": {"type": "json_object"}}
    assert structured_fields("s", {"json_object": False, "structural_tag": None}) == {}
    assert structured_fields("s", None) == {} and structured_fields("s", "") == {}
    p = parse_request(sp({"guided_decoding": {"choice": ["yes", "no"]}})).params
    assert p.guided_choice == ["yes", "no"]


def test_structured_errors_name_the_key():
    for value, where in (({"structural_tag": '{"type": "x"}'}, "structured_outputs.structural_tag"),
                         ({"json_object": "yes"}, "structured_outputs.json_object"),
                         ({"foo": 1}, "structured_outputs.foo"),
                         ([1], "structured_outputs")):
        with pytest.raises(ValueError) as e:
            parse_request(sp({"structured_outputs": value}))
        assert str(e.value).startswith(f"sampling_parameters.{where}:"), str(e.value)
    with pytest.raises(ValueError, match="also given as sampling_parameters.guided_regex"):
        parse_request(sp({"guided_regex": "a", "guided_decoding": {"json": SCHEMA}}))
    with pytest.raises(ValueError, match=r"^sampling_parameters\.structured_outputs\.json: not valid"):
        parse_request(sp({"structured_outputs": {"json": "{oops"}}))


def test_structured_nulls_pass():
    assert parse_request(sp({"structured_outputs": None, "guided_decoding": None})).params.guided \
        is None


def test_lora_name_null_is_the_base_model_a_name_is_passed_on():
    """null (vllm_backend's clients send it) is the base model; a name reaches SamplingParams
    (the engine refuses a name it has no adapter for); a non-string is an error naming it."""
    req = parse_request(sp({"lora_name": None, "max_tokens": 3}))
    assert req.params.max_tokens == 3 and req.params.lora_name is None
    assert parse_request(sp({"lora_name": "doc-qa"})).params.lora_name == "doc-qa"
    with pytest.raises(ValueError, match=r"^sampling_parameters\.lora_name: must be a string"):
        parse_request(sp({"lora_name": 5}))


def test_buckets_1_2_5():
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]
    assert buckets_1_2_5(8192)[-1] == 5000
