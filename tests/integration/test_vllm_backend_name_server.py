"""Our model served under the backend name "vllm" (config `backend: "vllm"`, the Python-based
backend backend.serve places in its backend directory): what Triton's OpenAI frontend needs to
allow logprobs. The frontend reads the backend name from the model config (its
`_get_model_metadata`: `model.config()["backend"]`) and refuses logprobs unless it is "vllm";
then it sends vLLM's request format, whose tensor set and response reading
test_openai_contract.py mirrors and this file reuses. One server for the file."""
from __future__ import annotations

import json
import urllib.request

import pytest

from tests.integration.conftest import BASE_PARAMS, NO_WARMUP, Server, make_repo
from tests.integration.test_openai_contract import (PROMPT, chat_sampling, completions_sampling,
                                                    frontend_inputs, frontend_view, infer)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def vllm_named(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-named")
    srv = Server(make_repo(d / "repo", {**BASE_PARAMS, **NO_WARMUP}, backend="vllm"),
                 d / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_config_names_the_vllm_backend(vllm_named):
    with urllib.request.urlopen(f"http://{vllm_named.http_url}/v2/models/llm/config") as r:
        config = json.load(r)
    assert config["backend"] == "vllm"  # what the frontend's logprobs check compares
    assert config.get("runtime", "model.py") == "model.py"  # a Python-based backend
    assert config["model_transaction_policy"]["decoupled"] is True
    inputs = {i["name"] for i in config["input"]}
    assert {"text_input", "stream", "exclude_input_in_output", "sampling_parameters",
            "return_logprobs", "return_num_input_tokens", "return_num_output_tokens"} <= inputs


def _check_logprobs(view: dict, n: int, k: int) -> None:
    """The frontend's reading: one position per generated token, each sorted by rank with the
    chosen (greedy: rank 1) token first; its decoded_tokens make up the text."""
    assert view["usage"]["completion_tokens"] == n and view["usage"]["prompt_tokens"] > 0
    assert len(view["logprobs"]) == n
    for pos in view["logprobs"]:
        assert [e["rank"] for _, e in pos] == list(range(1, k + 1))
        assert all(set(e) == {"logprob", "rank", "decoded_token"} for _, e in pos)
        lps = [e["logprob"] for _, e in pos]
        assert lps == sorted(lps, reverse=True) and all(v <= 0 for v in lps)
        assert all(int(t) >= 0 for t, _ in pos)
    assert "".join(pos[0][1]["decoded_token"] for pos in view["logprobs"]) == view["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_with_logprobs_as_the_frontend_sends_them(vllm_named, stream):
    n, k = 8, 2
    responses = infer(vllm_named.grpc_url, frontend_inputs(
        PROMPT, stream, completions_sampling(n, logprobs=k, temperature=0, ignore_eos=True),
        return_logprobs=True))
    view = frontend_view(responses)
    if not stream:
        assert view["num_data"] == 1 and len(responses) <= 2 and responses[-1]["final"]
    _check_logprobs(view, n, k)


def test_chat_top_logprobs_streamed(vllm_named):
    n, k = 6, 3
    responses = infer(vllm_named.grpc_url, frontend_inputs(
        PROMPT, True, chat_sampling(n, top_logprobs=k, temperature=0, ignore_eos=True),
        return_logprobs=True))
    _check_logprobs(frontend_view(responses), n, k)
