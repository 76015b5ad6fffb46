"""Speculative decoding by prompt lookup in the engine: output with speculation on equal to
speculation off (greedy, float32: verify rows run the decode kernels, whose per-row results do not
depend on the batch), with stops, logprobs, sampling, preemption and TP; the bench commands. The
drafting policy alone: test_speculation_policy.py."""
from __future__ import annotations

import random

import pytest

from backend import LLM, SamplingParams
from backend.engine.speculation.speculator import CPU_STEP_COST


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


class OracleDrafts:
    """Stands in for NgramIndex: drafts the reference run's own continuation, with some drafts
    wrong on purpose (a random model never copies its prompt, so real n-grams rarely hit): every
    path of verification is taken — all accepted, some, none — deterministically."""
    expected: list[list[int]] = []
    last_start = None  # its drafts are copied from nowhere: no copy to follow

    def __init__(self, n: int):
        pass

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for full in self.expected:
            if full[:len(token_ids)] == token_ids:
                draft = full[len(token_ids):len(token_ids) + k]
                where = len(token_ids) % 4  # 0: none right, 1: first only, 2: two, 3: all
                if where < len(draft):
                    draft[where] = (draft[where] + 1) % 500
                return draft
        return [7, 7]  # not a reference sequence: a wrong guess


@pytest.fixture
def oracle(monkeypatch):
    monkeypatch.setattr("backend.engine.speculation.speculator.NgramIndex", OracleDrafts)
    OracleDrafts.expected = []
    return OracleDrafts


def _fixed_costs(llm: LLM) -> LLM:
    """The built-in step-cost table in place of the one warmup timed on this machine
    (step_cost.py, tested in test_step_cost.py): which drafts the policy makes depends on those
    costs, and the tests below assert that drafts were made, on a tiny model whose measured
    costs are mostly this host's noise (a CI run timed one where no draft paid off)."""
    llm.engine.speculator.cost = CPU_STEP_COST
    return llm


@pytest.fixture(scope="module")
def pair(tiny_text_model):
    kw = dict(model=str(tiny_text_model), num_kv_blocks=128, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=256)
    on = _fixed_costs(LLM(**kw, speculative_ngram=4, speculative_ngram_match=2))
    off = LLM(**kw, warmup=False)
    yield on, off
    on.close(), off.close()


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _reference(off: LLM, prompts, sps, oracle) -> list:
    want = off.generate(prompts, sps)
    oracle.expected = [list(p) + w.token_ids for p, w in zip(prompts, want)]
    return want


def test_greedy_tokens_identical_with_speculation(pair, oracle):
    on, off = pair
    before = on.stats
    prompts = [_ids(30 + i, i) for i in range(5)]
    want = _reference(off, prompts, GREEDY, oracle)
    got = on.generate(prompts, GREEDY)  # together: verify rows of several sequences per step
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    for p, w in zip(prompts[:2], want):  # alone: a batch-1 step of 1 + k rows
        assert on.generate(p, GREEDY)[0].token_ids == w.token_ids
    s = on.stats
    drafted = s["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = s["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted < drafted
    # accepted drafts are tokens that took no step of their own
    assert s["steps"] - before["steps"] < s["sampled_tokens"] - before["sampled_tokens"]
    assert s["cold_path"] == {}  # verify steps are decode buckets, warmed before ready
    assert off.stats["spec_draft_tokens"] == 0
    on.engine.kv.check([])


def test_stops_inside_an_accepted_run_and_logprobs(pair, oracle):
    on, off = pair
    prompt = _ids(33, 7)
    full = off.generate(prompt, GREEDY)[0].token_ids
    stop_at = full[len(full) // 2]
    for sp in (SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_at]),
               SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, top_logprobs=2,
                              repetition_penalty=1.3, min_tokens=5)):
        w = _reference(off, [prompt], sp, oracle)[0]
        g = on.generate(prompt, sp)[0]
        assert (g.token_ids, g.finish_reason, g.stop_reason) == \
            (w.token_ids, w.finish_reason, w.stop_reason)
        assert g.text == w.text and g.num_output_tokens == w.num_output_tokens
        if sp.top_logprobs:
            assert len(g.logprobs) == len(g.token_ids)
            assert g.logprobs == w.logprobs  # bit-identical rows: equal floats
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
    on.engine.kv.check([])


def test_sampled_and_greedy_requests_together(pair, oracle):
    """A seeded sampled request beside greedy ones that speculate: it never gets drafts, and its
    tokens are the same as without speculation (its rows' logits do not depend on the batch)."""
    on, off = pair
    prompts = [_ids(31, 11), _ids(32, 12), _ids(33, 13)]
    sps = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=40,
                                  ignore_eos=True), GREEDY]
    want = _reference(off, prompts, sps, oracle)
    before = on.stats["spec_draft_tokens"]
    assert [o.token_ids for o in on.generate(prompts, sps)] == [o.token_ids for o in want]
    assert on.stats["spec_draft_tokens"] > before


def test_preemption_and_chunked_prefill_with_speculation(tiny_text_model, oracle):
    """A pool too small for every sequence (preemptions, recompute) and a 16-token step budget
    (prompts in chunks, requests joining while others decode): the same tokens, no leak."""
    kw = dict(model=str(tiny_text_model), num_kv_blocks=20, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=16)
    prompts = [_ids(40, 20 + i) for i in range(5)]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(**kw, speculative_ngram=3, speculative_ngram_match=2) as on, \
            LLM(**kw, warmup=False) as off:
        _fixed_costs(on)
        want = _reference(off, prompts, sp, oracle)
        got = on.generate(prompts, sp)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert on.stats["preemptions"] > 0 and on.stats["spec_accepted_tokens"] > 0
        assert on.stats["cold_path"] == {}
        on.engine.kv.check([])


def test_ngram_drafts_pay_off_on_a_copying_task(default_model_dir):
    """The real drafter on the real model: asked to copy a list, it accepts most drafts, and the
    tokens are those of plain greedy decoding."""
    items = ", ".join(f"item {i}: {w}" for i, w in enumerate(
        "apple river stone cloud maple tiger violet anchor pepper silver".split()))
    sp = SamplingParams(temperature=0, max_tokens=48)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=256, num_kv_blocks=64, warmup=False)
    with LLM(str(default_model_dir), **kw, speculative_ngram=4) as on:
        prompt = on.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Repeat this list exactly:\n{items}"}],
            tokenize=False, add_generation_prompt=True)
        g = on.generate(prompt, sp)[0]
        stats = on.stats
    with LLM(str(default_model_dir), **kw) as off:
        want = off.generate(prompt, sp)[0]
    assert g.token_ids == want.token_ids
    assert stats["spec_accepted_tokens"] >= len(g.token_ids) // 3, stats
    assert stats["steps"] <= len(g.token_ids) * 3 // 4 + 2, stats


def test_settings_are_validated(tiny_text_model):
    for bad in (dict(speculative_ngram=-1), dict(speculative_ngram_match=0),
                dict(speculative_ngram=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LLM(model=str(tiny_text_model), warmup=False, **bad)


def test_tensor_parallel_with_speculation(tiny_text_model, oracle):
    """TP 2: rank 0 drafts and verifies, the other rank runs the same decode rows."""
    kw = dict(model=str(tiny_text_model), num_kv_blocks=64, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=128, tensor_parallel_size=2, num_threads=1)
    prompts = [_ids(35, 60 + i) for i in range(3)]
    with LLM(**kw, warmup=False) as off:
        want = _reference(off, prompts, GREEDY, oracle)
    with LLM(**kw, speculative_ngram=4, speculative_ngram_match=2) as on:
        _fixed_costs(on)
        got = on.generate(prompts, GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert on.stats["spec_accepted_tokens"] > 0 and on.stats["cold_path"] == {}


@pytest.mark.parametrize("command", ["speculation", "decode"])
def test_bench_speculation_smoke(tiny_text_model, tmp_path, command):
    """`bench speculation` (and `bench decode --parts 2`, the same workloads) end to end at toy
    sizes (a tiny random model: the ratios mean nothing)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    out = tmp_path / "spec.json"
    opts = ["prompts", "3", "max-tokens", "12", "concurrency", "3", "rounds", "2"]
    prefix = "--" if command == "speculation" else "--spec-"
    args = [prefix + x if i % 2 == 0 else x for i, x in enumerate(opts)]
    args += ["--wait-policy", "passive"] if command == "speculation" else ["--parts", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "client", "bench", command, "--model", str(tiny_text_model),
         *args, "--out", str(out)],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    data = data["part2"] if command == "decode" else data
    if command == "decode":
        data["info"] = json.loads(out.read_text())["info"]
    for key in ("grounded_batch1", "chat_batch1", "grounded_concurrent"):
        assert data[key]["off"]["output_tokens"] == data[key]["on"]["output_tokens"] > 0
        assert data[key]["ratio"] > 0
    assert len(data["grounded_concurrent"]["rounds"]) == 2  # (c): a ratio per round, the median's
    for w in data["grounded_concurrent"]["work"]:  # and each round's engine work
        assert w["on"]["steps"] > 0 and w["off"]["steps"] > 0 and w["off"]["drafts"] == 0
        assert w["on"]["model_s"] > 0 and w["off"]["model_s"] > 0
    assert data["grounded_batch1"]["identical"] == "3/3" and data["chat_batch1"]["identical"] == "3/3"
    for key in ("grounded_batch1", "chat_batch1"):  # and the same after each first token
        for name in ("off", "on"):
            r = data[key][name]
            assert 0 < r["first_token_s"] < r["seconds"] and r["after_first_tok_s"] > 0
    assert "after each request's first token" in proc.stdout
    assert data["info"]["kernel_isa"] in ("avx512_bf16", "avx512", "avx2", "generic")
    assert "(a) input-grounded, batch 1" in proc.stdout and "drafts accepted" in proc.stdout


def test_bench_speculation_server_work_reads_exported_counters(monkeypatch):
    """`bench speculation --server`'s (c) rounds record each server's engine steps and drafts
    from its counters, by names the backend exports (a renamed metric fails here, not after a
    15-minute run), and the report prints them beside each round's ratio."""
    from backend.triton.metrics import COUNTERS
    from client.bench import bench_speculation as bs
    monkeypatch.setattr(bs.time, "sleep", lambda s: None)
    values = {"llm_engine_steps_total": 217.0, "llm_spec_draft_tokens_total": 15.0,
              "llm_model_seconds_total": 51.25}

    class FakeServer:
        def metric(self, name: str) -> float:
            assert name in COUNTERS, f"{name} is not an exported counter"
            return values[name]

    target = bs.ServerTarget.__new__(bs.ServerTarget)  # no tritonserver: only its counters
    target.server = FakeServer()
    assert target.work() == {"steps": 217, "drafts": 15, "model_s": 51.25}
    c = {"rounds": [0.95], "work": [{"on": {"steps": 217, "drafts": 15, "model_s": 51.25},
                                     "off": {"steps": 219, "drafts": 0, "model_s": 49.0}}]}
    assert bs._work_line(c) == ("(c) rounds on/off: 0.950 (steps 217/219, 15 drafts, "
                                "in steps 51.2/49.0 s)\n")


def test_engine_snapshot_never_shows_more_accepted_than_drafted():
    """The metrics snapshot (response thread) reads the engine's counters while the engine
    thread updates them: a verify step landing between its reads of the two speculation
    counters must not export more accepted drafts than drafts (the engine adds drafts first,
    so accepted is read first)."""
    from backend.engine.stats import EngineStats
    from backend.triton.metrics import engine_snapshot
    from tests.idle_engine import idle_engine

    class RacingStats(EngineStats):
        """Runs one verify step (3 drafts, all accepted) right after the first read of either
        speculation counter."""
        stepped = False

        def __getattribute__(self, name):
            value = super().__getattribute__(name)
            if name in ("spec_draft_tokens", "spec_accepted_tokens") and not self.stepped:
                self.stepped = True
                self.spec_draft_tokens += 3
                self.spec_accepted_tokens += 3
            return value

    engine = idle_engine(RacingStats())
    snap = engine_snapshot(engine)
    assert engine.stats.stepped
    assert snap["spec_accepted_tokens"] <= snap["spec_draft_tokens"], snap
