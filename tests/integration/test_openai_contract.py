"""The request Triton's OpenAI-compatible frontend sends with `--backend vllm`
(server repo, python/openai/openai_frontend/engine/utils/triton.py, _create_vllm_generate_request),
tensor for tensor, for /v1/completions and /v1/chat/completions, streaming and not; the responses
read the way the frontend reads them (usage summed over streamed responses, the logprobs JSON
sorted by rank)."""
from __future__ import annotations

import json
import queue

import numpy as np
import pytest

pytestmark = pytest.mark.integration
PROMPT = "The capital of France is"


def frontend_inputs(prompt: str, stream: bool, sampling: dict, return_logprobs: bool,
                    echo: bool | None = None) -> dict[str, np.ndarray]:
    """Exactly the frontend's tensor set (dtypes and shapes as its numpy arrays give them)."""
    return {"text_input": np.array([prompt.encode()], dtype=object),
            "stream": np.bool_([stream]),
            "exclude_input_in_output": np.bool_([True if echo is None else not echo]),
            "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=object),
            "return_logprobs": np.bool_([return_logprobs]),
            "return_num_input_tokens": np.bool_([True]),
            "return_num_output_tokens": np.bool_([True])}


def completions_sampling(max_tokens: int, logprobs: int | None = None, **kw) -> dict:
    """model_dump(exclude=..., exclude_none=True) of a CreateCompletionRequest: the defaults of
    every field it does not exclude, then max_tokens and logprobs set explicitly."""
    d = {"frequency_penalty": 0, "ignore_eos": False, "n": 1, "presence_penalty": 0,
         "temperature": 1, "top_p": 1, **kw, "max_tokens": max_tokens}
    if logprobs:
        d["logprobs"] = logprobs
    return d


def chat_sampling(max_tokens: int, top_logprobs: int | None = None, **kw) -> dict:
    d = {"frequency_penalty": 0, "ignore_eos": False, "n": 1, "presence_penalty": 0,
         "temperature": 0.7, "top_p": 1, **kw, "max_tokens": max_tokens}
    if top_logprobs is not None:
        d["logprobs"] = top_logprobs
    return d


def infer(url: str, inputs: dict[str, np.ndarray]) -> list[dict]:
    """One request over a gRPC stream; every response as {output: numpy}, plus 'final'."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype
    client = grpcclient.InferenceServerClient(url)
    q: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    tensors = []
    for name, arr in inputs.items():
        t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        tensors.append(t)
    client.async_stream_infer("llm", tensors, enable_empty_final_response=True)
    out = []
    try:
        while True:
            result, error = q.get(timeout=300)
            if error is not None:
                raise RuntimeError(error.message())
            resp = result.get_response()
            d = {o.name: result.as_numpy(o.name) for o in resp.outputs}
            d["final"] = resp.parameters["triton_final_response"].bool_param
            out.append(d)
            if d["final"]:
                return out
    finally:
        client.stop_stream()
        client.close()


def frontend_view(responses: list[dict]) -> dict:
    """What the frontend makes of the responses: the text, the usage (streaming: prompt tokens
    from the first response, completion tokens summed), and OpenAI chat-format logprobs (each
    position's entries sorted by rank; the first is taken as the chosen token)."""
    data = [r for r in responses if len(r) > 1]  # the empty final flag carries no outputs
    text = "".join(r["text_output"][0].decode() for r in data)
    usage = {"prompt_tokens": int(data[0]["num_input_tokens"][0]),
             "completion_tokens": sum(int(r["num_output_tokens"][0]) for r in data)}
    positions = []
    for r in data:
        if "logprobs" in r:
            for entry in json.loads(r["logprobs"][0].decode()):
                positions.append(sorted(entry.items(), key=lambda kv: kv[1]["rank"]))
    return {"text": text, "usage": usage, "logprobs": positions, "num_data": len(data)}


@pytest.mark.parametrize("stream", [False, True])
def test_completions_greedy_with_logprobs(server, offline, stream):
    from backend import SamplingParams
    n, k = 12, 3
    responses = infer(server.grpc_url, frontend_inputs(
        PROMPT, stream, completions_sampling(n, logprobs=k, temperature=0, ignore_eos=True),
        return_logprobs=True))
    view = frontend_view(responses)
    if not stream:  # exactly one response (or one plus an empty final)
        assert view["num_data"] == 1 and len(responses) <= 2 and responses[-1]["final"]
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                  top_logprobs=k))[0]
    assert view["text"] == ref.text  # exclude_input_in_output: the completion only
    assert view["usage"] == {"prompt_tokens": ref.num_input_tokens, "completion_tokens": n}
    assert len(view["logprobs"]) == n
    for pos, tok, ref_pos in zip(view["logprobs"], ref.token_ids, ref.logprobs):
        ids = [int(t) for t, _ in pos]
        assert ids[0] == tok  # greedy: the chosen token is rank 1
        assert ids == [t.token_id for t in ref_pos.top]  # the chosen one is among the top k
        assert [e["rank"] for _, e in pos] == list(range(1, k + 1))
        lps = [e["logprob"] for _, e in pos]
        assert lps == sorted(lps, reverse=True) and all(v <= 0 for v in lps)
        assert lps == pytest.approx([t.logprob for t in ref_pos.top], abs=2e-3)
        assert pos[0][1]["decoded_token"] == offline.tokenizer.decode([tok])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_template_prompt_and_sampling_fields(server, offline, stream):
    """The frontend renders the chat template itself and sends its OpenAI sampling fields;
    with a seed and no logprobs (return_logprobs false, so no `logprobs` output)."""
    prompt = offline.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], tokenize=False,
        add_generation_prompt=True)
    sampling = chat_sampling(10, seed=7, temperature=0.7, top_p=0.9, presence_penalty=0.5,
                             frequency_penalty=0.2, stop=["\n\n"], min_tokens=2)
    a = infer(server.grpc_url, frontend_inputs(prompt, stream, sampling, False))
    b = infer(server.grpc_url, frontend_inputs(prompt, stream, sampling, False))
    va, vb = frontend_view(a), frontend_view(b)
    assert va["text"] == vb["text"] and va["text"]  # seeded: reproducible
    assert not va["logprobs"] and all("logprobs" not in r for r in a)
    assert 1 <= va["usage"]["completion_tokens"] <= 10
    assert va["usage"]["prompt_tokens"] == len(offline.tokenizer.encode(prompt))
    if not stream:
        assert va["num_data"] == 1


def test_chat_logprobs_true_without_top_logprobs_and_echo(server, offline):
    """Chat `logprobs: true` without top_logprobs: the frontend sends logprobs=1; completions
    `echo: true` turns exclude_input_in_output off (the prompt comes back first)."""
    responses = infer(server.grpc_url, frontend_inputs(
        PROMPT, False, chat_sampling(4, top_logprobs=1, temperature=0, ignore_eos=True), True,
        echo=True))
    view = frontend_view(responses)
    assert view["text"].startswith(PROMPT) and len(view["logprobs"]) == 4
    assert all(len(pos) == 1 and pos[0][1]["rank"] == 1 for pos in view["logprobs"])


def test_bad_logprobs_is_an_error_for_that_request_only(server):
    with pytest.raises(RuntimeError, match="sampling_parameters.logprobs: must be in"):
        infer(server.grpc_url, frontend_inputs(PROMPT, True, completions_sampling(4, logprobs=99),
                                               True))
    assert server.ready()


# ---- the builder's other cases (server repo, engine/utils/triton.py, per release) ------------
TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
               "required": ["city"], "additionalProperties": False}


def structured_outputs_text(schema: dict) -> str:
    """json.dumps(asdict(StructuredOutputsParams(json=tool.parameters.model_dump_json()))): a
    named (or required) tool_choice, frontends from 25.11."""
    return json.dumps({"json": json.dumps(schema), "regex": None, "choice": None,
                       "grammar": None, "json_object": None, "disable_fallback": False,
                       "disable_any_whitespace": False, "disable_additional_properties": False,
                       "whitespace_pattern": None, "structural_tag": None, "_backend": None,
                       "_backend_was_auto": False})


def guided_decoding_text(schema: dict) -> str:
    """json.dumps(asdict(GuidedDecodingParams.from_optional(json=...))): frontends 25.05-25.10."""
    return json.dumps({"json": json.dumps(schema), "regex": None, "choice": None,
                       "grammar": None, "json_object": None, "backend": None,
                       "backend_was_auto": False, "disable_fallback": False,
                       "disable_any_whitespace": False, "disable_additional_properties": False,
                       "whitespace_pattern": None, "structural_tag": None})


def old_frontend_inputs(prompt: str, stream: bool, sampling: dict) -> dict[str, np.ndarray]:
    """Frontends 25.08-25.10: no return_logprobs tensor; chat's `logprobs: false` and
    completions' `best_of: 1` stay in sampling_parameters."""
    d = frontend_inputs(prompt, stream, sampling, False)
    del d["return_logprobs"]
    return d


def test_completions_stream_with_echo_sends_the_prompt_first(server, greedy):
    """`echo: true, stream: true` -> exclude_input_in_output false on a stream: the prompt
    text comes first, then the completion."""
    n = 8
    responses = infer(server.grpc_url, frontend_inputs(
        PROMPT, True, completions_sampling(n, temperature=0, ignore_eos=True), False, echo=True))
    data = [r for r in responses if len(r) > 1]
    assert data[0]["text_output"][0].decode().startswith(PROMPT)
    assert not any(r["text_output"][0].decode().startswith(PROMPT) for r in data[1:])
    view = frontend_view(responses)
    assert view["text"] == PROMPT + greedy(PROMPT, n, ignore_eos=True)
    assert view["usage"]["completion_tokens"] == n  # the echo is not counted as output


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_that_looks_like_json_is_one_stop_string(server, offline, stream):
    from backend import SamplingParams
    sampling = completions_sampling(12, temperature=0, stop="[END]")
    view = frontend_view(infer(server.grpc_url, frontend_inputs(PROMPT, stream, sampling, False)))
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12,
                                                  stop=["[END]"]))[0]
    assert view["text"] == ref.text and view["text"]


def test_seed_minus_one_is_accepted_and_reproducible(server):
    """The OpenAI schema's seed is any int64: -1 is the same generator as 2^64 - 1."""
    def text(seed):
        return frontend_view(infer(server.grpc_url, frontend_inputs(
            PROMPT, False, chat_sampling(10, seed=seed, temperature=1.0), False)))["text"]
    a = text(-1)
    assert a and a == text(-1) == text(2**64 - 1)


@pytest.mark.parametrize("old", [False, True])
def test_named_tool_choice_constrains_the_reply_to_the_tool_schema(server, offline, old):
    """tool_choice {"type": "function", "function": {"name": ...}} -> structured_outputs (or
    guided_decoding on older frontends) as JSON text in sampling_parameters."""
    prompt = offline.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Where is the Eiffel tower?"}], tokenize=False,
        add_generation_prompt=True)
    key, text = (("guided_decoding", guided_decoding_text(TOOL_SCHEMA)) if old else
                 ("structured_outputs", structured_outputs_text(TOOL_SCHEMA)))
    sampling = chat_sampling(40, temperature=0, **{key: text})
    if old:
        sampling.update(logprobs=False, best_of=1)
        inputs = old_frontend_inputs(prompt, False, sampling)
    else:
        inputs = frontend_inputs(prompt, False, sampling, False)
    view = frontend_view(infer(server.grpc_url, inputs))
    args = json.loads(view["text"])  # the tool call's arguments, as the frontend returns them
    assert set(args) == {"city"} and isinstance(args["city"], str)


def test_structural_tag_is_a_per_request_error_and_the_server_stays_up(server, greedy):
    bad = chat_sampling(8, structured_outputs=json.dumps({"structural_tag": '{"type": "x"}'}))
    with pytest.raises(RuntimeError, match="structured_outputs.structural_tag: not supported"):
        infer(server.grpc_url, frontend_inputs(PROMPT, False, bad, False))
    view = frontend_view(infer(server.grpc_url, frontend_inputs(
        PROMPT, False, completions_sampling(4, temperature=0), False)))
    assert view["text"] == greedy(PROMPT, 4)
