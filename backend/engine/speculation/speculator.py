"""Speculative decoding without a draft model (n-gram / prompt lookup).

Per step, each running greedy sequence that is decoding may get up to k draft tokens from its own
context (ngram.py). The step then computes the sequence's last token plus its drafts as k + 1
*decode rows* of the same sequence: row i is the token at position p + i and attends to the
cache up to p + i (its own K/V and the rows before it are written before any attention runs).
So verification uses exactly the decode kernels, and every row's logits are bit-identical to
what plain decoding would compute at that position (the small-batch GEMV and the paged decode
attention give a row the same result whatever else is in the batch), which is why greedy output
is token-identical with speculation on (float32). Each row's logits go through the normal
sampler; the sequence keeps the longest run of drafts the model agrees with plus the model's
own next token, and its computed-token count is wound back to the accepted positions (the K/V
written for rejected drafts sit past it and are overwritten later).

Only greedy requests speculate (temperature ~0, no grammar): a sampled request would need the
rejection-sampling rule to keep its distribution, and a grammar would need its matcher advanced
per draft; both simply decode one token a step. Penalties, min_tokens, stop strings and
logprobs work unchanged: each row is sampled as a view of the sequence with the drafts before it
appended.

Where a draft comes from (SpecState.candidate), best evidence first: what followed the most
recent earlier occurrence of the context's last `match` tokens ("suffix"); else the copy the
previous draft came from, while the output is in step with it ("follow") and for one step
after they part ("diverged": continued past the token where the model differed, as for a
renamed variable or a list's next number, where one token is new and the rest of the line
still follows the source); else shorter suffixes, longest first ("short3" for 3 tokens or
more, "short2", "short1"); else the parted copy again. A copy runs on into itself past the
context's end, so a loop of period p drafts whole periods. Why the parted copy yields to
shorter suffixes after one step: in replays of bench speculation's outputs a copy still parted
was rarely right where even a 1-token suffix often was (`python -m client bench spec-replay`:
greedy outputs are fixed, so each draft's fate is known without the model).

How long (Acceptance.length): each sequence keeps, per source, a recent record of how often
its drafts' first token was right and how often a later token was, given the one before it
was; the draft length d (0 to k) is the one with the most expected tokens per unit of step
cost (StepCost: what a step of r rows costs in one-row steps). Why a cost model: a verify row
is not free where a step's multiply-adds are no longer hidden under the weight read. On CPU
the first rows are cheap (still under the weight read) and later ones cost a fifth of a
one-row step or more each (step_cost.py), so a source that has been wrong lately drafts one
token or none, a reliable one up to k. With
d 0 the token the draft would have started with is still checked against the one decoded
(for free: nothing is verified), so a source that becomes right again is drafted from again.
This replaced fixed
rules (one token after a miss, at most 5 from a copy, pauses after repeated misses), which
drafted far more rejected tokens on free-form chat for the same accepted ones (docs/decisions.md,
"Draft sources and lengths"; `python -m client bench speculation`). Drafts are only proposed
while every running sequence is decoding and nothing waits for admission (prompts go first,
and a verify step stays a decode-only step: the fused decode kernels), and only while the
step's rows stay within `max_rows` (on CPU 8: big batches are compute-bound and gain nothing);
with several sequences in a step a draft is weighed against the whole step's tokens and cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.engine.speculation.ngram import NgramIndex, agreeing, copy_from
from backend.engine.sampling.sampling_params import SamplingParams
from backend.engine.sequence import Sequence

_GREEDY_EPS = 1e-5  # the sampler decodes rows below this temperature greedily
CPU_VERIFY_ROWS = 8  # decode rows (drafts included) of a CPU step that may carry drafts
_DECAY = 0.9  # how much of a source's record an older verification keeps, per new one
_PRIOR_WEIGHT = 4.0  # a new sequence's record: this many verifications at the priors' rates
# Before any evidence, each source's first-token and later-token acceptance: a whole-suffix
# match or a copy still in step is often right; the token right after the output left its
# copy (bench speculation's grounded prompts: ~0.2) and a short suffix less often, the
# shorter the less (first tokens of 3-, 2- and 1-token suffixes there: 63%, 34%, 33%).
# (Chosen by replay, `python -m client bench spec-replay`, over (0.7, 0.85), 0.25 and weight 2:
# later tokens were less sure than assumed; docs/decisions.md, "Draft sources and lengths".)
_PRIORS = {"suffix": (0.6, 0.75), "follow": (0.6, 0.75), "diverged": (0.15, 0.8),
           "short3": (0.65, 0.8), "short2": (0.4, 0.7), "short1": (0.35, 0.6)}


@dataclass(frozen=True)
class StepCost:
    """What a decode step of r rows costs, in one-row steps: table[r - 1] as measured; past the
    table, its last increment per further row (no table: 1 + per_row * (r - 1))."""
    table: tuple[float, ...] = ()
    per_row: float = 0.0

    def __call__(self, rows: int) -> float:
        t = self.table
        if rows <= len(t):
            return t[rows - 1]
        if len(t) < 2:
            return (t[-1] if t else 1.0) + self.per_row * (rows - max(1, len(t)))
        return t[-1] + (t[-1] - t[-2]) * (rows - len(t))


# CPU: measured at 2, 4, 6 and 8 rows on an AVX-512 CPU whose multiply-adds are cheap next to
# its memory bandwidth, 3, 5 and 7 in between (docs/decisions.md, "Draft sources and lengths").
# An engine that warms up replaces it with its own machine's (step_cost.py: on other CPUs a row
# costs more); this table serves engines without warmup.
CPU_STEP_COST = StepCost((1.0, 1.095, 1.28, 1.47, 1.63, 1.80, 2.05, 2.32))
# a GPU decode step stays bound by its weight read for a few rows (not measured: no GPU has
# been lent to this project yet)
GPU_STEP_COST = StepCost(per_row=0.02)


@dataclass
class Acceptance:
    """One draft source's recent record in one sequence: how often its first token was right,
    and each later token given that the one before it was (decayed: recent evidence counts
    most, so a sequence that stops copying stops drafting within a few steps)."""
    first_hits: float
    first_tries: float
    later_hits: float
    later_tries: float

    @classmethod
    def prior(cls, source: str) -> Acceptance:
        first, later = _PRIORS[source]
        w = _PRIOR_WEIGHT
        return cls(first * w, w, later * w, w)

    def record_first(self, hit: bool) -> None:
        self.first_tries = self.first_tries * _DECAY + 1
        self.first_hits = self.first_hits * _DECAY + hit

    def record(self, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` tokens of which the first `accepted` were right."""
        self.record_first(accepted > 0)
        # token i > 1 is put to the test only when token i - 1 was accepted; the record decays
        # only when it learns something (so later_tries stays >= 1 once anything was tried)
        tried = min(accepted, drafted - 1)
        if tried:
            self.later_tries = self.later_tries * _DECAY + tried
            self.later_hits = self.later_hits * _DECAY + accepted - 1

    def length(self, limit: int, tokens: float, rows: int, cost: StepCost
               ) -> tuple[int, float]:
        """The draft length in [0, limit] that gives the step (so far `tokens` expected tokens
        in `rows` rows) the most tokens per cost, and the tokens it adds."""
        first = self.first_hits / self.first_tries
        later = self.later_hits / self.later_tries
        best, best_rate, best_gain = 0, tokens / cost(rows), 0.0
        gain, p = 0.0, first  # p: the chance that drafts 1..d are all accepted
        for d in range(1, limit + 1):
            gain += p
            p *= later
            rate = (tokens + gain) / cost(rows + d)
            if rate > best_rate:
                best, best_rate, best_gain = d, rate, gain
        return best, best_gain


def _records() -> dict[str, Acceptance]:
    return {source: Acceptance.prior(source) for source in _PRIORS}


@dataclass
class SpecState:
    """One sequence's drafting state."""
    indices: list[NgramIndex]  # the longest n-gram first, down to single tokens
    records: dict[str, Acceptance]  # per draft source
    follow: int | None = None  # where the copy the last draft came from goes on (see candidate)
    start: int | None = None  # where this step's candidate was copied from
    source: str | None = None  # this step's candidate's source
    shadow: int | None = None  # no draft this step: the token the candidate started with
    parted: bool = False  # the followed copy and the output parted and have not met again

    def candidate(self, token_ids: list[int], limit: int) -> tuple[str, list[int]] | None:
        """Up to `limit` tokens (limit >= 1) of the best-evidence draft, and its source (module
        doc): what followed the most recent earlier occurrence of the whole suffix of
        token_ids (speculative_ngram_match tokens); failing that, the copy the last draft came
        from while in step with the output, or for one step after they part (continued past
        the token the model put in place of the draft's); failing that, shorter suffixes,
        longest first; failing that, the parted copy. None: nothing occurred before."""
        self.start = None
        longest, *shorter = self.indices
        if draft := longest.propose(token_ids, limit):
            self.start, self.parted = longest.last_start, False
            return "suffix", draft
        f = self.follow if self.follow is not None and self.follow < len(token_ids) else None
        if f is not None:
            in_step = f > 0 and token_ids[f - 1] == token_ids[-1]
            if in_step or not self.parted:
                self.parted = not in_step
                self.start = f
                return ("follow" if in_step else "diverged"), copy_from(token_ids, f, limit)
        for index in shorter:
            if draft := index.propose(token_ids, limit):
                self.start = index.last_start
                return f"short{min(index.n, 3)}", draft
        if f is not None:
            self.start = f
            return "diverged", copy_from(token_ids, f, limit)
        return None

    def advanced(self, appended: int) -> None:
        """The sequence appended `appended` tokens (accepted drafts and the model's own): the
        copy this step's candidate came from (or the one followed before, if there was none)
        goes on that much further, taking the model's token for the source's where they
        differ."""
        at = self.start if self.start is not None else self.follow
        self.follow = None if at is None else at + appended
        self.start = None


@dataclass
class DraftRow:
    """A verify row as the sampler sees it (a SamplingRow): the sequence with its first `drafts`
    drafts appended. token_ids is built only when read (penalties, min_tokens): greedy rows
    never read it, and each read copies the whole context."""
    seq: Sequence
    drafts: int

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.seq.draft_token_ids[:self.drafts]

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def generator(self) -> torch.Generator | None:
        return self.seq.generator


@dataclass
class NgramSpeculator:
    max_draft: int  # speculative_ngram
    match: int  # speculative_ngram_match
    max_rows: int  # decode rows (drafts included) a step may have
    cost: StepCost = CPU_STEP_COST  # a step's cost by its rows

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        p = seq.params
        return seq.guided is None and p.temperature < _GREEDY_EPS and seq.embedding is None

    def propose(self, running: list[Sequence], waiting: int, max_num_seqs: int) -> None:
        """Set draft_token_ids on the decoding sequences that get drafts this step."""
        for seq in running:
            seq.draft_token_ids = []
        decoding = [s for s in running if s.num_uncomputed == 1]
        if waiting or len(decoding) < len(running):
            return  # admission and prompt chunks first (and verify steps stay decode-only)
        # rows left: the step's decode rows, and every sampled row, stay within their limits
        room = min(self.max_rows - len(decoding), max_num_seqs - len(running))
        # the step so far: a token per sequence, for one row each
        tokens, rows = float(len(decoding)), len(decoding)
        for seq in decoding:
            if room <= 0:
                break
            if not self.eligible(seq):
                continue
            st = seq.spec
            if st is None:
                indices = [NgramIndex(n) for n in range(self.match, 0, -1)]
                st = seq.spec = SpecState(indices, _records())
            st.source = st.shadow = None
            left = seq.params.max_tokens - seq.num_output_tokens - 1  # the bonus token is extra
            limit = min(self.max_draft, room, left)
            found = st.candidate(seq.token_ids, limit) if limit > 0 else None
            if found is None:
                continue
            st.source, draft = found
            d, gain = st.records[st.source].length(len(draft), tokens, rows, self.cost)
            if d == 0:
                st.shadow = draft[0]  # checked against the decoded token (observe)
                continue
            seq.draft_token_ids = draft[:d]
            room -= d
            tokens += gain
            rows += d

    @staticmethod
    def observe(seq: Sequence, token: int) -> None:
        """seq decoded `token` without drafts: the copy it follows moves on by one; a candidate
        not drafted (its shadow token) is scored against `token`, for free."""
        st = seq.spec
        if st is None:
            return
        st.advanced(1)
        if st.shadow is not None:
            st.records[st.source].record_first(st.shadow == token)
        st.source = st.shadow = None

    def verify_rows(self, seq: Sequence) -> list[DraftRow]:
        """The sampler rows of a verified sequence: the sequence itself, then one per draft."""
        return [seq, *(DraftRow(seq, i) for i in range(1, len(seq.draft_token_ids) + 1))]

    def accept(self, seq: Sequence, sampled: list[int]) -> int:
        """How many of seq's drafts the model agrees with (sampled: its k + 1 rows' tokens),
        recorded for the draft's source. The tokens to append are sampled[:accepted + 1]."""
        draft = seq.draft_token_ids
        a = agreeing(draft, sampled)
        st = seq.spec
        st.records[st.source].record(len(draft), a)
        st.advanced(a + 1)
        st.source = None
        return a
