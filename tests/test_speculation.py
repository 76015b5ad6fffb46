"""Speculative decoding by prompt lookup: the n-gram index, the adaptive drafting, and the engine's
output with speculation on equal to speculation off (greedy, float32: verify rows run the decode
kernels, whose per-row results do not depend on the batch)."""
from __future__ import annotations

import random

import pytest

from backend import LLM, SamplingParams
from backend.engine.speculation.ngram import NgramIndex
from backend.engine.sequence import Sequence
from backend.engine.speculation.speculator import (_PRIOR_WEIGHT, CPU_STEP_COST, GPU_STEP_COST, Acceptance,
                                        NgramSpeculator, StepCost)

FLAT = StepCost(per_row=0.2)  # a verify row costs 0.2 of a one-row step, however many


def test_ngram_index_finds_the_most_recent_earlier_occurrence():
    idx = NgramIndex(2)
    ids = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
    assert idx.propose(ids, 3) == [5, 6, 1]  # after the second [1, 2], not the first
    ids += [5]
    assert idx.propose(ids, 3) == [6, 1, 2]  # [2, 5] occurred once, followed by 6, 1, 2
    ids += [9, 9]
    assert idx.propose(ids, 3) == []  # [9, 9]: never seen before (the suffix itself is not)
    # [9, 9] then 9: one token followed it so far; the copy goes on into itself
    assert idx.propose(ids + [9], 2) == [9, 9] and idx.last_start == len(ids)
    assert NgramIndex(3).propose([1, 2, 3], 4) == []  # too short to have a predecessor
    assert NgramIndex(1).propose([7, 8, 7], 0) == []
    # a loop of period 3: the draft is the next period and more, not the 1 token seen after
    assert NgramIndex(2).propose([5, 6, 7, 5, 6, 7, 5, 6], 5) == [7, 5, 6, 7, 5]


def _running(ids: list[int], temperature: float = 0.0, max_tokens: int = 100) -> Sequence:
    seq = Sequence("s", list(ids), len(ids) - 1, SamplingParams(temperature=temperature,
                                                                max_tokens=max_tokens), 0)
    seq.num_computed_tokens = len(ids) - 1  # decoding: only the last token is new
    return seq


def test_propose_limits():
    free = StepCost(per_row=0.0)  # rows cost nothing: every draft as long as the limits allow
    spec = NgramSpeculator(max_draft=4, match=2, max_rows=8, cost=free)
    ids = list(range(10)) + [3, 4]
    greedy, sampled = _running(ids), _running(ids, temperature=0.7)
    spec.propose([greedy, sampled], waiting=0, max_num_seqs=8)
    assert greedy.draft_token_ids == [5, 6, 7, 8] and sampled.draft_token_ids == []
    assert greedy.spec.source == "suffix"
    spec.propose([greedy], waiting=1, max_num_seqs=8)  # admission first: no drafts
    assert greedy.draft_token_ids == []
    spec.propose([greedy], waiting=0, max_num_seqs=3)  # sampled rows stay <= max_num_seqs
    assert greedy.draft_token_ids == [5, 6]
    short = _running(ids, max_tokens=3)  # 1 generated so far... the bonus token counts too
    short.num_prompt_tokens = len(ids) - 1
    spec.propose([short], waiting=0, max_num_seqs=8)
    assert short.draft_token_ids == [5]
    full = NgramSpeculator(max_draft=4, match=2, max_rows=3, cost=free)  # rows, drafts included
    spec_rows = _running(ids)
    full.propose([spec_rows], waiting=0, max_num_seqs=8)
    assert spec_rows.draft_token_ids == [5, 6]


def test_draft_length_weighs_the_sources_record_against_the_cost_of_a_row():
    rec = Acceptance.prior("suffix")
    alone = rec.length(7, 1.0, 1, FLAT)[0]
    assert 3 <= alone < 7  # a fair record: not every row it may have
    for _ in range(6):
        rec.record(7, 7)  # every token right, again and again: every row
    assert rec.length(7, 1.0, 1, FLAT)[0] == 7
    assert rec.length(3, 1.0, 1, FLAT)[0] == 3  # within the limit
    for _ in range(25):
        rec.record(7, 0)  # the first token wrong every time: no draft at all
    assert rec.length(7, 1.0, 1, FLAT) == (0, 0.0)
    for _ in range(5):
        rec.record_first(True)  # its would-be first tokens right again (shadows): drafts again
    assert rec.length(7, 1.0, 1, FLAT)[0] > 0
    # rows that cost nothing: every row that might be accepted; rows as dear as a step: none
    assert Acceptance.prior("short2").length(7, 1.0, 1, StepCost(per_row=0.0))[0] == 7
    assert Acceptance.prior("suffix").length(7, 1.0, 1, StepCost(per_row=1.0))[0] == 0
    # beside other sequences a draft is weighed against the whole step's tokens per cost: the
    # same record drafts less next to three others (4 tokens for 1.6 steps already)
    busy = Acceptance.prior("short2").length(7, 4.0, 4, FLAT)[0]
    assert busy < Acceptance.prior("short2").length(7, 1.0, 1, FLAT)[0]
    # one-token drafts, accepted, however many: nothing to learn about later tokens, and the
    # record stays usable (it once decayed towards 0 / 0)
    ones = Acceptance.prior("diverged")
    for _ in range(5000):
        ones.record(1, 1)
    assert ones.later_tries == _PRIOR_WEIGHT and ones.length(7, 1.0, 1, FLAT)[0] > 1
    # the expected tokens it adds: the chances that drafts 1..d are all right, summed
    gain = Acceptance(1.0, 2.0, 3.0, 4.0).length(2, 1.0, 1, StepCost(per_row=0.0))
    assert gain == (2, 0.5 + 0.5 * 0.75)


def test_step_cost_by_rows():
    """A step's cost in one-row steps: the measured table, then its last increment per row;
    CPU's first verify rows are cheap (still under the weight read), so a draft the flat 0.2
    a row would skip can pay there."""
    cost = StepCost((1.0, 1.1, 1.3))
    assert [cost(r) for r in (1, 2, 3)] == [1.0, 1.1, 1.3]
    assert cost(5) == pytest.approx(1.7)  # 1.3 + 2 x 0.2
    assert GPU_STEP_COST(1) == 1.0 and GPU_STEP_COST(3) == pytest.approx(1.04)
    assert StepCost((1.0,), per_row=0.5)(3) == 2.0
    assert CPU_STEP_COST(1) == 1.0 and CPU_STEP_COST(2) < FLAT(2)
    assert all(CPU_STEP_COST(r) < CPU_STEP_COST(r + 1) for r in range(1, 12))
    shaky = Acceptance(0.13, 1.0, 0.0, 1.0)  # first token right 13% of the time, never more
    assert shaky.length(7, 1.0, 1, FLAT)[0] == 0 and shaky.length(7, 1.0, 1, CPU_STEP_COST)[0] == 1


def test_a_source_that_keeps_missing_stops_drafting_until_its_shadow_hits():
    spec = NgramSpeculator(max_draft=4, match=2, max_rows=8)
    ids = list(range(10)) + [3, 4]
    seq = _running(ids)
    for _ in range(40):  # the suffix match [3, 4] -> 5... is wrong every time
        spec.propose([seq], waiting=0, max_num_seqs=8)
        if not seq.draft_token_ids:
            break
        assert seq.spec.source == "suffix"
        assert spec.accept(seq, [0] * (len(seq.draft_token_ids) + 1)) == 0
        seq.draft_token_ids = []  # (the context stays: the next step sees the same suffix)
    assert seq.draft_token_ids == [] and seq.spec.shadow == 5
    misses = seq.spec.records["suffix"].first_hits
    spec.observe(seq, 0)  # decoded something else: scored as a miss, for free
    assert seq.spec.records["suffix"].first_hits < misses and seq.spec.shadow is None
    drafted = False
    for _ in range(8):  # the model now decodes what the draft would have started with
        spec.propose([seq], waiting=0, max_num_seqs=8)
        if seq.draft_token_ids:
            drafted = True
            break
        spec.observe(seq, 5)
    assert drafted and seq.draft_token_ids[0] == 5


def _append(seq: Sequence, tokens: list[int]) -> None:
    seq.token_ids += tokens
    seq.num_computed_tokens = len(seq.token_ids) - 1  # decoding again


def _decode(spec: NgramSpeculator, seq: Sequence, model: list[int]) -> int:
    """One step: propose, then the model's tokens `model` for the rows (its own next token
    after each draft prefix); appends what the engine would. Returns the accepted count."""
    spec.propose([seq], waiting=0, max_num_seqs=8)
    if not seq.draft_token_ids:
        spec.observe(seq, model[0])
        _append(seq, model[:1])
        return 0
    a = spec.accept(seq, model[:len(seq.draft_token_ids) + 1])
    _append(seq, model[:a + 1])
    seq.draft_token_ids = []
    return a


def test_a_copy_goes_on_past_a_substituted_token():
    spec = NgramSpeculator(max_draft=4, match=3, max_rows=8)
    # source line [20, 21, 22, 23, 24, 25]; the output repeats it with 22 renamed to 90
    seq = _running([1, 2, 20, 21, 22, 23, 24, 25, 26, 3, 20, 21])
    # [3, 20, 21] is new; [20, 21] occurred: a short suffix's draft, [22, 23] (its prior)
    spec.propose([seq], waiting=0, max_num_seqs=8)
    assert seq.draft_token_ids == [22, 23] and seq.spec.source == "short2"
    assert _decode(spec, seq, [90, 23, 24]) == 0
    assert seq.token_ids[-3:] == [20, 21, 90]
    # [20, 21, 90] never occurred: the copy goes on after the 22 the model replaced, before
    # any shorter suffix; right after the output left its copy, one token
    spec.propose([seq], waiting=0, max_num_seqs=8)
    assert seq.draft_token_ids == [23] and seq.spec.source == "diverged"
    seq.draft_token_ids = []
    assert _decode(spec, seq, [23, 24]) == 1
    # back in step with the copy ([90, 23, 24] occurred nowhere): as many tokens of it as a
    # followed copy's prior asks for (3 of the 4 allowed)
    spec.propose([seq], waiting=0, max_num_seqs=8)
    assert seq.draft_token_ids == [25, 26, 3] and seq.spec.source == "follow"


def test_a_parted_copy_yields_to_shorter_suffixes_after_one_step():
    """Right after the output parts from its copy, the copy drafts once more (one token may
    be new); after that a shorter suffix comes first (a parted copy is seldom right again),
    and the parted copy only where no suffix occurred before."""
    spec = NgramSpeculator(max_draft=4, match=3, max_rows=8)
    seq = _running([1, 2, 20, 21, 22, 23, 24, 25, 26, 7, 8, 9, 3, 20, 21, 22])
    spec.propose([seq], waiting=0, max_num_seqs=8)
    assert seq.spec.source == "suffix" and seq.draft_token_ids[0] == 23
    seq.draft_token_ids = []
    assert _decode(spec, seq, [50]) == 0  # the model parts from the copy: 50, not 23
    spec.propose([seq], waiting=0, max_num_seqs=8)
    assert seq.spec.source == "diverged" and seq.draft_token_ids == [24]
    seq.draft_token_ids = []
    assert _decode(spec, seq, [7]) == 0  # still parted; [7] occurred before (then 8)
    spec.propose([seq], waiting=0, max_num_seqs=8)
    assert seq.spec.source == "short1" and seq.draft_token_ids == [8]
    seq.draft_token_ids = []
    parted = _running([1, 2, 20, 21, 22, 23, 24, 25, 26, 3, 20, 21, 22])
    spec.propose([parted], waiting=0, max_num_seqs=8)
    parted.draft_token_ids = []
    _decode(spec, parted, [50])  # parted: 50 for 23
    _decode(spec, parted, [51])  # the one step after parting: 51 for 24
    spec.propose([parted], waiting=0, max_num_seqs=8)  # no suffix of [.., 50, 51] occurred
    assert parted.spec.source == "diverged" and parted.spec.start == 7  # the copy, at 25


def test_shorter_ngrams_when_the_whole_suffix_never_occurred():
    spec = NgramSpeculator(max_draft=4, match=3, max_rows=8)
    seq = _running(list(range(10)) + [8, 3, 4])  # [8, 3, 4] is new, [3, 4] occurred before
    spec.propose([seq], waiting=0, max_num_seqs=8)
    assert seq.draft_token_ids[0] == 5 and seq.spec.source == "short2"
    single = _running([1, 2, 3, 9, 9, 7, 1])  # only the last token occurred before
    spec.propose([single], waiting=0, max_num_seqs=8)
    # a 1-token suffix is right less often than a longer one: its prior asks for one token
    assert single.draft_token_ids == [2] and single.spec.source == "short1"
    assert _decode(spec, single, [2, 3]) == 1
    spec.propose([single], waiting=0, max_num_seqs=8)
    assert single.spec.source == "suffix"  # [1, 2, 3] is a whole-suffix match now
    assert single.draft_token_ids[:2] == [9, 9]
    fresh = _running([1, 2, 3])
    spec.propose([fresh], waiting=0, max_num_seqs=8)
    assert fresh.draft_token_ids == [] and fresh.spec.shadow is None  # nothing occurred before


def test_rows_that_cost_nothing_draft_every_token_a_copy_has():
    # a GPU-like cost (rows nearly free): a followed copy drafts max_draft
    spec = NgramSpeculator(max_draft=7, match=3, max_rows=64, cost=StepCost(per_row=0.0))
    source = list(range(20, 40))
    seq = _running([1] + source + [2, 20, 21])  # [2, 20, 21] is new, [20, 21] occurred
    spec.propose([seq], waiting=0, max_num_seqs=8)
    assert seq.draft_token_ids == list(range(22, 29))


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
