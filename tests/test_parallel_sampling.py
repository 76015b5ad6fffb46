"""Parallel sampling (n > 1) in the engine: one prefill shared by n samples, each sample an
ordinary sequence afterwards (backend/engine/parallel_sampling.py)."""
from __future__ import annotations

import json

import pytest

from backend import LLM
from backend.engine.sampling.sampling_params import SamplingParams

ENGINE = dict(num_threads=2, max_num_batched_tokens=64, max_num_seqs=8, block_size=8,
              num_kv_blocks=96)
PROMPT = "The quick brown fox jumps over the lazy dog and then"  # not a whole number of blocks


@pytest.fixture(scope="module")
def llm(tiny_text_model):
    with LLM(model=str(tiny_text_model), **ENGINE) as engine:
        yield engine


def _texts(out) -> list[str]:
    return [o.text for o in out.outputs]


def test_greedy_samples_equal_one_greedy_request_and_share_the_prefill(llm):
    one = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    before = llm.engine.stats.scheduled_tokens
    out = llm.generate(PROMPT, SamplingParams(n=4, temperature=0, max_tokens=12,
                                              ignore_eos=True))[0]
    computed = llm.engine.stats.scheduled_tokens - before
    assert [o.token_ids for o in out.outputs] == [one.token_ids] * 4
    assert _texts(out) == [one.text] * 4
    assert [o.finish_reason for o in out.outputs] == ["length"] * 4
    # the prompt once (less what the prefix cache held), then 11 decode tokens per sample
    uncached = out.num_input_tokens - out.num_cached_tokens
    assert computed == uncached + 4 * 11
    assert llm.engine.kv.num_used_blocks == 0
    llm.engine.kv.check([])


def test_seeded_samples_differ_and_repeat(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    a = llm.generate(PROMPT, params)[0]
    b = llm.generate(PROMPT, params)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3
    # sample 0 draws from seed 7 as an n = 1 request would (same logits row, same generator)
    first = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=7, max_tokens=1))[0]
    assert a.outputs[0].token_ids[0] == first.token_ids[0]


def test_samples_finish_on_their_own(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12)
    out = llm.generate([PROMPT, "Hello"], [params, SamplingParams(temperature=0, max_tokens=5)])
    assert len(out[0].outputs) == 4 and len(out[1].outputs) == 1
    for o in out[0].outputs:
        assert o.finish_reason in ("stop", "length") and 1 <= len(o.token_ids) <= 12
    assert out[0].num_output_tokens == sum(len(o.token_ids) for o in out[0].outputs)


def test_abort_frees_every_sample(llm):
    engine = llm.engine
    req = engine.prepare_request("abort-me", PROMPT, SamplingParams(n=5, max_tokens=40,
                                                                   ignore_eos=True))
    engine.add_request(req.request_id, req)
    steps = 0
    while len(engine.scheduler.running) < 5 and steps < 20:  # until it forked
        engine.step()
        steps += 1
    assert len(engine.scheduler.running) == 5
    engine.step()
    out = engine.abort_request("abort-me")
    assert out.finished and out.finish_reason == "abort"
    assert not engine.has_unfinished() and not engine.scheduler.has_work()
    assert engine.kv.num_used_blocks == 0
    engine.kv.check([])


def test_n_is_checked(llm):
    with pytest.raises(ValueError, match=r"^n: at most max_num_seqs \(8\)"):
        llm.engine.prepare_request("x", PROMPT, SamplingParams(n=9))
    with pytest.raises(ValueError, match=r"^n: must be >= 1"):
        SamplingParams(n=0)


def test_structured_samples_each_match(llm):
    choices = ["red", "green", "blue"]
    out = llm.generate(PROMPT, SamplingParams(n=6, temperature=1.0, seed=1, max_tokens=8,
                                              guided_choice=choices))[0]
    assert len(out.outputs) == 6 and all(o.text in choices for o in out.outputs)


def test_samples_under_kv_pressure_stay_exact(tiny_text_model):
    """A pool too small for every sample's copy: the fork falls back to recomputing (and the
    scheduler preempts), and each greedy sample is still the n = 1 text."""
    kw = dict(ENGINE, num_kv_blocks=5)
    with LLM(model=str(tiny_text_model), **kw) as small:
        one = small.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20,
                                                    ignore_eos=True))[0]
        out = small.generate(PROMPT, SamplingParams(n=6, temperature=0, max_tokens=20,
                                                    ignore_eos=True))[0]
        assert [o.token_ids for o in out.outputs] == [one.token_ids] * 6
        assert small.engine.kv.num_used_blocks == 0


def test_tensor_parallel_samples_copy_on_every_rank(tiny_text_model):
    with LLM(model=str(tiny_text_model), tensor_parallel_size=2, **dict(ENGINE, num_threads=1),
             warmup=False) as tp:
        one = tp.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10,
                                                 ignore_eos=True))[0]
        out = tp.generate(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=10,
                                                 ignore_eos=True))[0]
    assert [o.token_ids for o in out.outputs] == [one.token_ids] * 3
