"""client/bench/spec_replay.py: replaying the draft policy over recorded greedy outputs takes the
engine's own steps (the same drafts, the same accepted tokens), so its modeled speedups speak
for the engine."""
from __future__ import annotations

import pytest

from backend import LLM, SamplingParams
from backend.engine.speculation.speculator import NgramSpeculator, StepCost
from client.bench.spec_replay import _longest_copy, any_copy, perfect_lengths, replay, replay_one
from tests.test_speculation import OracleDrafts, _ids


@pytest.fixture
def oracle(monkeypatch):
    # as in test_speculation: drafts from the reference outputs, some wrong on purpose, so
    # every verification path (all, some, none accepted) is taken on a random model
    monkeypatch.setattr("backend.engine.speculation.speculator.NgramIndex", OracleDrafts)
    OracleDrafts.expected = []
    return OracleDrafts


def test_replay_takes_the_engines_steps(tiny_text_model, oracle):
    kw = dict(model=str(tiny_text_model), num_kv_blocks=128, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=256)
    off = LLM(**kw, warmup=False)
    on = LLM(**kw, speculative_ngram=4, speculative_ngram_match=2, warmup=False)
    try:
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        prompts = [_ids(n, seed) for n, seed in ((12, 1), (20, 2), (7, 3))]
        outputs = [o.token_ids for o in off.generate(prompts, sp)]
        oracle.expected = [p + o for p, o in zip(prompts, outputs)]
        for prompt, output in zip(prompts, outputs):
            before = dict(on.stats)
            got = on.generate([prompt], sp)[0].token_ids
            assert got == output
            steps = on.stats["steps"] - before["steps"]
            drafted = on.stats["spec_draft_tokens"] - before["spec_draft_tokens"]
            accepted = on.stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            r = replay_one(NgramSpeculator(4, 2, 8), prompt, output, sp.max_tokens)
            assert accepted > 0 and drafted > accepted  # both paths taken
            assert (r.drafted, r.accepted) == (drafted, accepted)
            assert r.steps + 1 == steps  # + the prefill step, which drafts nothing
            assert r.tokens == len(output) - 1
    finally:
        on.close(), off.close()


def test_replay_weighs_steps_by_their_rows():
    """The output copies the prompt; rows cost nothing to the speculator, so it drafts all 7
    it may: one plain step (the first token after the prefill's occurred nowhere before), then
    five steps of 7 drafts, all accepted, each costing the 8-row entry of the table."""
    prompt = list(range(100, 140))
    output = [1] + prompt
    costs = StepCost((1.0, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 2.0))
    free = StepCost(per_row=0.0)  # the speculator's own cost model: rows cost nothing
    r = replay(lambda: NgramSpeculator(7, 2, 8, cost=free), [(prompt, output)], 64, costs)
    assert (r.tokens, r.steps, r.drafted, r.accepted) == (40, 6, 35, 35)
    assert r.cost == 1.0 + 5 * 2.0 and r.speedup == 40 / 11.0


def test_bounds_on_a_copied_prompt():
    """perfect_lengths drafts the policy's own candidates, cut to what is accepted: nothing
    after the prefill's token (which occurred nowhere before), then the prompt 7 tokens a step,
    the last step only the 6 the output still has (never past its last token). any_copy finds
    the prompt as soon as the coming output starts it: one step fewer."""
    prompt = list(range(100, 140))
    output = [1] + prompt
    costs = StepCost((1.0, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 2.0))
    r = perfect_lengths([(prompt, output)], 7, 2, costs)
    assert (r.tokens, r.steps, r.drafted, r.accepted) == (40, 6, 34, 34)
    assert r.cost == 1.0 + 4 * 2.0 + 1.5
    c = any_copy([(prompt, output)], 7, costs)
    assert (c.tokens, c.steps, c.drafted, c.accepted) == (40, 5, 35, 35)
    assert c.cost == 5 * 2.0 and c.speedup > r.speedup


def test_longest_copy_runs_on_into_what_it_drafts():
    # a period of 3 in the context drafts whole periods, as ngram.copy_from does
    assert _longest_copy([7, 8, 9, 7], [8, 9, 7, 8, 9, 7, 8, 9], 7) == 7
    assert _longest_copy([7, 8, 9, 7], [8, 9, 7, 8, 9, 7, 8, 9], 4) == 4
    assert _longest_copy([1, 2, 3], [2, 4], 7) == 1
    assert _longest_copy([1], [5], 7) == 0 and _longest_copy([1], [], 7) == 0


def test_bench_spec_replay_smoke(tiny_text_model, tmp_path):
    """`bench spec-replay` end to end at toy sizes (a tiny random model: the figures mean
    nothing): the engine's own warmup table weighs the steps, and both bounds are reported."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    out = tmp_path / "replay.json"
    proc = subprocess.run(
        [sys.executable, "-m", "client", "bench", "spec-replay", "--model", str(tiny_text_model),
         "--prompts", "3", "--max-tokens", "12", "--out", str(out)],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["step_costs_source"] == "the engine's, measured here at warmup"
    table = data["step_costs"]
    assert len(table) == 8 and table[0] == 1.0 and table == sorted(table)
    for name in ("(a) grounded", "(b) chat"):
        r = data["result"][name]
        assert r["plain_steps"] > 0 and r["speedup"] > 0
        assert r["perfect_lengths_speedup"] > 0 and r["any_copy_speedup"] > 0
    assert "bounds: perfect lengths" in proc.stdout
