"""Speculative decoding by prompt lookup, its drafting policy without a model: the n-gram index,
which drafts a sequence proposes and how many (the sources' records against a row's cost)."""
from __future__ import annotations

import pytest

from backend import SamplingParams
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
