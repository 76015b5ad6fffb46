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

Where a draft comes from (SpecState.propose), best evidence first: what followed the most
recent earlier occurrence of the context's last `match` tokens; else the copy the previous draft
came from, continued past the token where the model differed (a renamed variable, a list's next
number: one token is new, the rest of the line still follows the source); else shorter suffixes,
down to one token. A copy runs on into itself past the context's end, so a loop of period p
drafts whole periods. How long: a whole-suffix match gets every row the step has room for (up
to k); the other sources get `copy_rows` (k, or 5 on CPU) after a draft that was at least
partly accepted and a single token after one that was not, or before any was verified (the
measured acceptance of each source, ~0.2 for the first token of a copy followed after a miss
against 0.6-1.0 otherwise, is why). Why 5 on CPU: over bench speculation's grounded prompts
(AVX2 AMD EPYC, k 7, match 4) a followed copy's drafts were all accepted through position i
with probability 0.73, 0.66, 0.62, 0.62, 0.55, then 0.10 and 0.01 at positions 6 and 7, and a
verify row costs ~3.2 ms against a ~17 ms one-row step there (its GEMV multiply-adds are not
hidden under the weight read): a row pays only if it is used with probability above ~0.2.
After consecutive drafts with nothing accepted the sequence stops proposing for a doubling
number of steps (a no-overlap workload then runs plain decode steps), and it resumes as soon
as the token it would have drafted first is the one the model decodes (checked for free:
nothing is verified while paused). Drafts are only proposed while every running sequence is
decoding and nothing waits for admission (prompts go first, and a verify step stays a
decode-only step: the fused decode kernels), and only while the step's rows stay within
`max_rows` (on CPU 8: a step stays bound by reading the weights; big batches are compute-bound
and gain nothing).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.engine.ngram import NgramIndex, copy_from
from backend.engine.sampling_params import SamplingParams
from backend.engine.sequence import Sequence

_GREEDY_EPS = 1e-5  # the sampler decodes rows below this temperature greedily
_MAX_PAUSE = 64  # steps without proposals after repeated misses, at most
CPU_VERIFY_ROWS = 8  # decode rows (drafts included) of a CPU step that may carry drafts
CPU_COPY_ROWS = 5  # the most drafts, on CPU, of a copy that is not a whole-suffix match


@dataclass
class SpecState:
    """One sequence's drafting state."""
    indices: list[NgramIndex]  # the longest n-gram first, down to single tokens
    k: int  # tokens a draft not from a whole-suffix match may have (1 after a miss)
    misses: int = 0  # consecutive verifications that accepted nothing
    pause: int = 0  # steps left without proposing
    shadow: int | None = None  # while paused: the token a draft would have started with
    follow: int | None = None  # where the copy the last draft came from goes on (see propose)
    start: int | None = None  # where this step's draft was copied from

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """What followed the most recent earlier occurrence of the longest suffix of token_ids
        (speculative_ngram_match tokens) that occurred before, `limit` tokens of it: a whole
        suffix matched is good evidence. Failing that, self.k tokens (at most `limit`) of the
        copy the last draft came from, continued past the token the model put in place of the
        draft's (a renamed variable, the next number of a list: one token differs, the rest of
        the line is still the source's); failing that, of shorter suffixes, down to one token."""
        self.start = None
        longest, *shorter = self.indices
        if draft := longest.propose(token_ids, limit):
            self.start = longest.last_start
            return draft
        k = min(self.k, limit)
        if self.follow is not None and self.follow < len(token_ids) and k > 0:
            self.start = self.follow
            return copy_from(token_ids, self.follow, k)
        for index in shorter:
            if draft := index.propose(token_ids, k):
                self.start = index.last_start
                return draft
        return []

    def advanced(self, appended: int) -> None:
        """The sequence appended `appended` tokens (accepted drafts and the model's own): the
        copy this step's draft came from (or the one followed before, if nothing was drafted)
        goes on that much further, taking the model's token for the source's where they
        differ."""
        at = self.start if self.start is not None else self.follow
        self.follow = None if at is None else at + appended
        self.start = None


@dataclass
class DraftRow:
    """A verify row as the sampler sees it: the sequence with the drafts before this row."""
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None


@dataclass
class NgramSpeculator:
    max_draft: int  # speculative_ngram
    match: int  # speculative_ngram_match
    max_rows: int  # decode rows (drafts included) a step may have
    copy_rows: int | None = None  # drafts of a copy not from a whole-suffix match (None: max_draft)

    @property
    def copy_k(self) -> int:
        """k after an accepted draft: copy_rows (max_draft when unset), at most max_draft."""
        return min(self.max_draft, self.copy_rows or self.max_draft)

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        p = seq.params
        return seq.guided is None and p.temperature < _GREEDY_EPS

    def propose(self, running: list[Sequence], waiting: int, max_num_seqs: int) -> None:
        """Set draft_token_ids on the decoding sequences that get drafts this step."""
        for seq in running:
            seq.draft_token_ids = []
        decoding = [s for s in running if s.num_uncomputed == 1]
        if waiting or len(decoding) < len(running):
            return  # admission and prompt chunks first (and verify steps stay decode-only)
        # rows left: the step's decode rows, and every sampled row, stay within their limits
        room = min(self.max_rows - len(decoding), max_num_seqs - len(running))
        for seq in decoding:
            if room <= 0:
                break
            if not self.eligible(seq):
                continue
            st = seq.spec
            if st is None:
                # no evidence yet: one token, as after a miss
                st = seq.spec = SpecState([NgramIndex(n) for n in range(self.match, 0, -1)], 1)
            if st.pause > 0:
                st.pause -= 1
                shadow = st.propose(seq.token_ids, 1)
                st.shadow = shadow[0] if shadow else None
                continue
            left = seq.params.max_tokens - seq.num_output_tokens - 1  # the bonus token is extra
            draft = st.propose(seq.token_ids, min(self.max_draft, room, left))
            seq.draft_token_ids = draft
            room -= len(draft)

    @staticmethod
    def observe(seq: Sequence, token: int) -> None:
        """seq decoded `token` without drafts: the copy it follows moves on by one; if it is
        paused and its draft would have started with `token`, drafting pays again, so the pause
        ends (costs nothing: no row was verified)."""
        st = seq.spec
        if st is None:
            return
        st.advanced(1)
        if st.shadow is not None:
            if st.shadow == token:
                st.pause = st.misses = 0
            st.shadow = None

    def verify_rows(self, seq: Sequence) -> list[DraftRow]:
        """The sampler rows of a verified sequence: the sequence itself, then one per draft."""
        rows: list = [seq]
        for i in range(1, len(seq.draft_token_ids) + 1):
            rows.append(DraftRow(seq.params, seq.token_ids + seq.draft_token_ids[:i],
                                 seq.num_prompt_tokens, seq.generator))
        return rows

    def accept(self, seq: Sequence, sampled: list[int]) -> int:
        """How many of seq's drafts the model agrees with (sampled: its k + 1 rows' tokens);
        adapts seq's k. The tokens to append are sampled[:accepted + 1]."""
        draft = seq.draft_token_ids
        a = 0
        while a < len(draft) and sampled[a] == draft[a]:
            a += 1
        st = seq.spec
        st.advanced(a + 1)
        if a:
            st.k, st.misses = self.copy_k, 0
        else:
            st.k, st.misses = 1, st.misses + 1
            if st.misses >= 2:
                st.pause = min(_MAX_PAUSE, 1 << st.misses)
        return a
