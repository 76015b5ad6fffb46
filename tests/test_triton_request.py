"""Triton request parsing, responses and model-config parameters without a server."""
import json

import numpy as np
import pytest

from backend.engine.outputs import RequestOutput
from backend.triton.model_config import check_transaction_policy, parse_parameters
from backend.triton.request import parse_messages, parse_request
from backend.triton.response import StreamState, mean_itl, record_tokens, tensors_for


def b(s):
    return np.array([s.encode()], dtype=object)


def test_tensor_inputs_trtllm_style():
    r = parse_request({"text_input": b("Hi"), "max_tokens": np.array([7], np.int32),
                       "stream": np.array([True]), "exclude_input_in_output": np.array([True]),
                       "min_length": np.array([3], np.int32),
                       "temperature": np.array([0.0], np.float32),
                       "seed": np.array([2**64 - 1], np.uint64),
                       "stop_words": np.array([b"\n\n", b""], dtype=object)})
    p = r.params
    assert (r.prompt, r.stream, r.exclude_input_in_output) == ("Hi", True, True)
    assert (p.max_tokens, p.min_tokens, p.temperature, p.seed, p.stop) == (7, 3, 0.0, 2**64 - 1, ["\n\n"])


def test_vllm_sampling_parameters_json_with_string_values():
    sp = json.dumps({"max_tokens": "5", "min_tokens": "5", "ignore_eos": "true", "temperature": 0,
                     "top_p": "0.9", "stop": ["x"], "stop_token_ids": [2]})
    r = parse_request({"text_input": b("Hi"), "sampling_parameters": b(sp)})
    p = r.params
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.top_p, p.stop, p.stop_token_ids) == \
        (5, 5, True, 0.9, ["x"], [2])
    assert r.stream is False and r.exclude_input_in_output is None  # not given


def test_precedence_tensor_over_parameters_over_sampling_json():
    sp = b(json.dumps({"max_tokens": 1, "top_k": 5, "temperature": 0.5}))
    r = parse_request({"text_input": b("x"), "sampling_parameters": sp,
                       "max_tokens": np.array([3], np.int32)},
                      json.dumps({"max_tokens": 2, "top_k": 7, "unrelated": "ignored"}))
    assert (r.params.max_tokens, r.params.top_k, r.params.temperature) == (3, 7, 0.5)


def test_request_parameters_types():
    r = parse_request({"text_input": b("x")}, {"temperature": 0.25, "ignore_eos": True,
                                               "stop_words": '["a", "b"]', "random_seed": 9})
    assert (r.params.temperature, r.params.ignore_eos, r.params.stop, r.params.seed) == \
        (0.25, True, ["a", "b"], 9)


def test_defaults_follow_vllm():
    r = parse_request({"text_input": b("x")})
    assert (r.params.max_tokens, r.params.temperature, r.stream) == (16, 1.0, False)
    # vllm_backend: no optional output unless its return_* flag is true
    assert r.returns == {"finish_reason": False, "num_input_tokens": False,
                         "num_output_tokens": False, "cumulative_logprob": False,
                         "logprobs": False, "num_cached_tokens": False}
    assert r.params.top_logprobs is None and not r.params.logprobs


def test_return_cumulative_logprob_turns_on_logprobs():
    r = parse_request({"text_input": b("x"), "return_cumulative_logprob": np.array([True])})
    assert r.params.logprobs and r.returns["cumulative_logprob"] is True


@pytest.mark.parametrize("inputs, params, field", [
    ({}, None, "text_input"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=object)}, None, "text_input"),
    ({"text_input": b("x"), "max_tokens": np.array([0], np.int32)}, None, "max_tokens"),
    ({"text_input": b("x"), "max_tokens": np.array([1, 2], np.int32)}, None, "max_tokens"),
    ({"text_input": b("x"), "temperature": np.array([-1], np.float32)}, None, "temperature"),
    ({"text_input": b("x"), "temperature": np.array([np.nan], np.float32)}, None, "temperature"),
    ({"text_input": b("x"), "top_p": np.array([0], np.float32)}, None, "top_p"),
    ({"text_input": b("x"), "top_k": np.array([-5], np.int32)}, None, "top_k"),
    ({"text_input": b("x"), "min_length": np.array([99], np.int32)}, None, "min_length"),
    ({"text_input": b("x"), "beam_width": np.array([2], np.int32)}, None, "beam_width"),
    ({"text_input": b("x"), "sampling_parameters": b("{bad")}, None, "sampling_parameters"),
    ({"text_input": b("x"), "sampling_parameters": b("[1]")}, None, "sampling_parameters"),
    ({"text_input": b("x"), "sampling_parameters": b('{"tempreature": 1}')}, None,
     "sampling_parameters"),
    ({"text_input": b("x"), "sampling_parameters": b('{"max_tokens": "lots"}')}, None,
     "sampling_parameters.max_tokens"),
    ({"text_input": b("x"), "sampling_parameters": b('{"n": 0}')}, None, "sampling_parameters.n"),
    ({"text_input": b("x"), "sampling_parameters": b('{"best_of": 2}')}, None,
     "sampling_parameters.best_of"),
    ({"text_input": b("x")}, {"ignore_eos": "maybe"}, "ignore_eos"),
    ({"text_input": b("x")}, {"max_tokens": 2.5}, "max_tokens"),
    ({"text_input": b("x")}, {"seed": -2**63 - 1}, "seed"),
    ({"text_input": b("x")}, {"seed": 2**64}, "seed"),
    ({"text_input": b("x"), "sampling_parameters": b('{"lora_name": 5}')}, None,
     "sampling_parameters.lora_name"),
    ({"text_input": b("x")}, {"lora_name": 5}, "lora_name"),
    ({"text_input": b("x"), "sampling_parameters": b(json.dumps(
        {"structured_outputs": {"structural_tag": "{}"}}))}, None,
     "sampling_parameters.structured_outputs.structural_tag"),
    ({"text_input": b("x"), "sampling_parameters": b(json.dumps(
        {"guided_decoding": {"json": {}, "regex": "a"}}))}, None,
     "sampling_parameters.guided_decoding"),
    ({"text_input": b("x"), "sampling_parameters": b(json.dumps(
        {"guided_decoding": {"jsn": {}}}))}, None, "sampling_parameters.guided_decoding.jsn"),
    ({"text_input": b("x"), "sampling_parameters": b(json.dumps(
        {"structured_outputs": "{not json"}))}, None, "sampling_parameters.structured_outputs"),
    ({"text_input": b("x"), "sampling_parameters": b(json.dumps(
        {"structured_outputs": {"choice": []}}))}, None,
     "sampling_parameters.structured_outputs.choice"),
    ({"text_input": b("x")}, {"repetition_penalty": 0}, "repetition_penalty"),
    ({"text_input": b("x")}, {"stop_words": "[oops"}, "stop_words"),
    ({"text_input": b("x"), "chat": np.array([True])}, None, None),  # plain text: one user turn
    ({"text_input": b("[1, 2]"), "chat": np.array([True])}, None, "text_input"),
])
def test_every_error_names_the_field(inputs, params, field):
    if field is None:
        assert parse_request(inputs, params).messages == [{"role": "user", "content": "x"}]
        return
    with pytest.raises(ValueError) as e:
        parse_request(inputs, params)
    assert str(e.value).startswith(field + ":"), str(e.value)


def test_chat_messages():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert parse_messages(json.dumps(msgs)) == msgs


def _state(**kw):
    r = parse_request({"text_input": b("Hi")}, kw)
    return StreamState("r", r, sender=None, arrival=0.0)


def _out(text, n, finished=False):
    return RequestOutput("r", text, [1], finished, "length" if finished else None, 2, n)


def test_streaming_sends_deltas_and_no_optional_output_unasked():
    s = _state(stream=True)
    assert tensors_for(s, _out("", 1)) is None  # empty delta: nothing sent
    d = tensors_for(s, _out(" a", 2))
    assert list(d) == ["text_output"] and d["text_output"][0] == b" a"
    d = tensors_for(s, _out("b", 3, finished=True))
    assert list(d) == ["text_output"] and d["text_output"][0] == b"b"


def test_streaming_vllm_backend_additional_outputs():
    """vllm_backend's rules (ci/L0_additional_outputs_vllm): finish_reason "None" until the
    final response; num_input_tokens on every response; num_output_tokens the tokens new on
    each response (UINT32, as vllm_backend declares them)."""
    s = _state(stream=True, return_finish_reason=True, return_num_input_tokens=True,
               return_num_output_tokens=True)
    assert tensors_for(s, _out("", 1)) is None
    d = tensors_for(s, _out(" a", 2))
    assert d["finish_reason"][0] == b"None" and d["num_input_tokens"][0] == 2
    assert d["num_output_tokens"][0] == 2
    assert d["num_input_tokens"].dtype == d["num_output_tokens"].dtype == np.uint32
    d = tensors_for(s, _out("b", 3, finished=True))
    assert d["finish_reason"][0] == b"length" and d["num_output_tokens"][0] == 1
    s = _state(stream=False, return_finish_reason=True, return_num_output_tokens=True)
    assert tensors_for(s, _out(" a", 1)) is None
    d = tensors_for(s, _out("b", 2, finished=True))
    assert d["finish_reason"][0] == b"length" and d["num_output_tokens"][0] == 2


def test_num_cached_tokens_only_when_asked_for():
    out = _out("b", 3, finished=True)
    out.num_cached_tokens = 32
    assert "num_cached_tokens" not in tensors_for(_state(stream=True), out)
    d = tensors_for(_state(stream=True, return_num_cached_tokens=True), _out(" a", 2))
    assert d["num_cached_tokens"].dtype == np.int32  # on every response once asked for
    d = tensors_for(_state(stream=True, return_num_cached_tokens="true"), out)
    assert d["num_cached_tokens"][0] == 32


def test_non_streaming_prepends_prompt_unless_excluded():
    s = _state()
    assert tensors_for(s, _out(" a", 1)) is None
    assert tensors_for(s, _out("b", 2, True))["text_output"][0] == b"Hi ab"
    s = _state(exclude_input_in_output=True, return_finish_reason=False)
    tensors_for(s, _out(" a", 1))
    d = tensors_for(s, _out("b", 2, True))
    assert d["text_output"][0] == b" ab" and "finish_reason" not in d


def test_streaming_echo_puts_the_prompt_on_the_first_response_only():
    s = _state(stream=True, exclude_input_in_output=False)
    assert tensors_for(s, _out("", 1)) is None
    assert tensors_for(s, _out(" a", 2))["text_output"][0] == b"Hi a"
    assert tensors_for(s, _out("b", 3, finished=True))["text_output"][0] == b"b"
    s = _state(stream=True)  # not given: a stream never repeats the prompt (vllm_backend)
    assert tensors_for(s, _out(" a", 1))["text_output"][0] == b" a"


def test_logprobs_output_is_null_without_k():
    """vllm_backend: return_logprobs without `logprobs` in sampling_parameters sends JSON null
    (and nothing is computed)."""
    s = _state(stream=True, return_logprobs=True)
    assert s.req.params.top_logprobs is None
    assert tensors_for(s, _out("a", 1))["logprobs"][0] == b"null"


def test_return_flag_true_on_every_response_and_requested_outputs():
    s = _state(stream=True, return_num_output_tokens=True)
    assert tensors_for(s, _out("a", 1))["num_output_tokens"][0] == 1
    s.requested = frozenset({"text_output"})
    assert list(tensors_for(s, _out("b", 2, True))) == ["text_output"]


def test_token_timing():
    s = _state(stream=True)
    s.arrival = 1.0
    assert mean_itl(s) is None
    assert record_tokens(s, _out("a", 1), 1.5) == 0.5
    assert record_tokens(s, _out("", 1), 1.7) is None  # no new token
    assert record_tokens(s, _out("bc", 3), 2.5) is None
    assert mean_itl(s) == 0.5


def test_model_config_parameters():
    cfg = {"parameters": {"max_num_seqs": {"string_value": "8"},
                          "model": {"string_value": "${model}"},
                          "kv_cache_memory_gb": {"string_value": "0.5"},
                          "enable_metrics": {"string_value": "false"}},
           "model_transaction_policy": {"decoupled": True}}
    kwargs, opts = parse_parameters(cfg)
    assert kwargs == {"max_num_seqs": 8, "kv_cache_memory_gb": 0.5} and not opts.enable_metrics
    check_transaction_policy(cfg)
    kwargs, _ = parse_parameters({"parameters": {"cpu_packed_gemm": {"string_value": "false"}}})
    assert kwargs == {"cpu_packed_gemm": False}
    from dataclasses import fields

    from backend.engine.config import EngineConfig
    from backend.triton.model_config import ENGINE_PARAMETERS
    assert {f for _, f in ENGINE_PARAMETERS.values()} <= {f.name for f in fields(EngineConfig)}
    with pytest.raises(ValueError, match="parameter max_num_seqs: must be an integer"):
        parse_parameters({"parameters": {"max_num_seqs": {"string_value": "many"}}})
    with pytest.raises(ValueError, match="parameter kv_budget: unknown"):
        parse_parameters({"parameters": {"kv_budget": {"string_value": "1"}}})
    with pytest.raises(ValueError, match="decoupled: true"):
        check_transaction_policy({})


def test_model_config_multi_host_parameters():
    cfg = {"parameters": {"tensor_parallel_size": {"string_value": "4"},
                          "tp_local_ranks": {"string_value": "2"},
                          "tp_master_addr": {"string_value": "10.0.0.1"},
                          "tp_master_port": {"string_value": "29600"},
                          "tp_collective_timeout_s": {"string_value": "30"}}}
    kwargs, _ = parse_parameters(cfg)
    assert kwargs == {"tensor_parallel_size": 4, "tp_local_ranks": 2, "tp_master_addr": "10.0.0.1",
                      "tp_master_port": 29600, "tp_collective_timeout_s": 30.0}
    from backend.engine.config import EngineConfig
    EngineConfig(**kwargs, device="cpu").validate()  # the engine accepts what the adapter passes
    with pytest.raises(ValueError, match="parameter tp_master_port"):
        parse_parameters({"parameters": {"tp_master_port": {"string_value": "x"}}})
