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
