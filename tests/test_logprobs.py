"""Per-token logprobs with top-k alternatives: sampler, offline API (OpenAI's logprobs/top_logprobs)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.sampling.logprobs import PositionLogprobs, TokenLogprob
from backend.engine.outputs import RequestOutput
from backend.engine.sampling.sampler import Sampler
from backend.triton.request import parse_request
from backend.triton.response import StreamState, tensors_for
from tests.test_sampler import row


def test_top_logprobs_are_the_raw_distributions_top_k():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    ref = logits.log_softmax(dim=-1)
    rows = [row([1, 2], [3], top_logprobs=3, temperature=0.7, repetition_penalty=1.5, top_p=0.9),
            row(logprobs=True),  # chosen logprob only, no positions
            row(top_logprobs=0, temperature=0.0, frequency_penalty=2.0),
            row(top_logprobs=5, temperature=1.0, seed=3)]
    out = Sampler(eos_token_ids={0}, seed=0)(logits.clone(), rows)
    assert out.position_logprobs[1] is None and out.logprobs[1] is not None
    for i, k in ((0, 3), (2, 0), (3, 5)):
        pos = out.position_logprobs[i]
        tok = out.token_ids[i]
        assert pos.chosen.token_id == tok
        assert pos.chosen.logprob == pytest.approx(float(ref[i, tok]), abs=1e-6)
        assert pos.chosen.rank == 1 + int((ref[i] > ref[i, tok]).sum())
        vals, ids = ref[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t.token_id for t in pos.top] == ids.tolist()
        assert [t.logprob for t in pos.top] == pytest.approx(vals.tolist(), abs=1e-6)
        assert [t.rank for t in pos.top] == list(range(1, k + 1))


def test_rank_of_a_token_that_is_not_the_argmax():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    # min_tokens forbids EOS (the argmax, 0) so greedy picks token 1: its rank is 2.
    out = Sampler(eos_token_ids={0})(logits.clone(), [row(top_logprobs=2, temperature=0.0,
                                                          min_tokens=1, max_tokens=4)])
    pos = out.position_logprobs[0]
    assert out.token_ids == [1] and pos.chosen.rank == 2
    assert [t.token_id for t in pos.top] == [0, 1]
    # vLLM's shape: the chosen token plus the top k, one entry per distinct token
    assert sorted(pos.as_vllm_dict()) == [0, 1]
    pos3 = PositionLogprobs(TokenLogprob(3, -5.0, 4), pos.top)
    assert sorted(pos3.as_vllm_dict()) == [0, 1, 3]


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_top_logprobs_out_of_range_names_the_field(bad):
    with pytest.raises(ValueError, match="^top_logprobs"):
        SamplingParams(top_logprobs=bad)


@pytest.fixture(scope="module")
def llm(tiny_text_model):
    return LLM(model=str(tiny_text_model), num_kv_blocks=256, block_size=8)


def test_offline_api_returns_per_token_logprobs(llm):
    greedy, off = llm.generate(["Hello there", "Bonjour"], [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, top_logprobs=4),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)])
    assert off.logprobs is None
    assert len(greedy.logprobs) == len(greedy.token_ids) == 6
    for tok, pos in zip(greedy.token_ids, greedy.logprobs):
        assert pos.chosen.token_id == tok and pos.chosen.rank == 1  # greedy: the argmax
        assert pos.top[0].token_id == tok and len(pos.top) == 4
        assert [t.logprob for t in pos.top] == sorted((t.logprob for t in pos.top), reverse=True)
        assert pos.chosen.decoded_token == llm.tokenizer.decode([tok])
        assert all(t.decoded_token is not None for t in pos.top)
    assert greedy.cumulative_logprob == pytest.approx(
        math.fsum(p.chosen.logprob for p in greedy.logprobs), abs=1e-4)
    # same text as without logprobs: asking for them changes nothing about the sampling
    assert greedy.text == llm.generate("Hello there", SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True))[0].text


# ---- the Triton layer: the `logprobs` output and per-response num_output_tokens ----------------

def _pos(tok: int, lp: float, rank: int = 1) -> PositionLogprobs:
    return PositionLogprobs(TokenLogprob(tok, lp, rank, f"t{tok}"),
                            [TokenLogprob(tok, lp, 1, f"t{tok}"), TokenLogprob(99, lp - 1, 2, "x")])


def _state(stream: bool):
    r = parse_request({"text_input": np.array([b"Hi"], dtype=object),
                       "stream": np.bool_([stream]), "return_logprobs": np.bool_([True]),
                       "return_num_output_tokens": np.bool_([True]),
                       "sampling_parameters": np.array([json.dumps({"logprobs": 1}).encode()],
                                                       dtype=object)})
    assert r.params.top_logprobs == 1
    return StreamState("r", r, sender=None, arrival=0.0)


def _out(text: str, n: int, tok: int, finished: bool = False):
    return RequestOutput("r", text, [tok], finished, "length" if finished else None, 2, n,
                         logprobs=[_pos(tok, -0.5 * n)])


def test_streaming_logprobs_of_empty_deltas_come_with_the_next_response():
    s = _state(stream=True)
    assert tensors_for(s, _out("", 1, 5)) is None  # no text yet (e.g. half a UTF-8 character)
    d = tensors_for(s, _out("ab", 2, 6))
    body = json.loads(d["logprobs"][0])
    assert [list(e) for e in body] == [["5", "99"], ["6", "99"]]
    assert body[0]["5"] == {"logprob": -0.5, "rank": 1, "decoded_token": "t5"}
    assert d["num_output_tokens"][0] == 2  # both tokens reported on this response
    d = tensors_for(s, _out("c", 3, 7, finished=True))
    assert [list(e) for e in json.loads(d["logprobs"][0])] == [["7", "99"]]
    assert d["num_output_tokens"][0] == 1  # summed over responses: 3 = the total


def test_non_streaming_sends_every_position_once():
    s = _state(stream=False)
    assert tensors_for(s, _out("a", 1, 5)) is None
    d = tensors_for(s, _out("b", 2, 6, finished=True))
    assert len(json.loads(d["logprobs"][0])) == 2 and d["num_output_tokens"][0] == 2


def _group(parts: list[tuple[str, int, int, bool]], finished: bool = False):
    """An n > 1 update: (text, num_output_tokens, token, sample finished) per sample."""
    samples = [RequestOutput("r", t, [tok] if t else [], done, "stop" if done else None, 2, n,
                             logprobs=[_pos(tok, -0.25 * n)] if t else None, index=i)
               for i, (t, n, tok, done) in enumerate(parts)]
    return RequestOutput("r", "", [], finished, "stop" if finished else None, 2,
                         sum(n for _, n, _, _ in parts), samples=samples)


def test_parallel_samples_each_report_their_own_logprobs_and_tokens():
    s = _state(stream=True)
    d = tensors_for(s, _group([("a", 1, 5, False), ("", 0, 0, False)]))
    assert list(d["text_output"]) == [b"a", b""]
    assert [len(json.loads(x)) for x in d["logprobs"]] == [1, 0]
    assert list(d["num_output_tokens"]) == [1, 0]
    assert tensors_for(s, _group([("", 1, 0, True), ("", 0, 0, False)])) is None  # nothing new
    d = tensors_for(s, _group([("", 1, 0, True), ("bc", 2, 7, True)], finished=True))
    assert list(d["text_output"]) == [b"", b"bc"]
    assert [list(e) for e in json.loads(d["logprobs"][1])] == [["7", "99"]]
    assert list(d["num_output_tokens"]) == [0, 2]
