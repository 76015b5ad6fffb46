"""Continuous batching: which sequences run this step and how many tokens each computes.

Every step has a token budget (max_num_batched_tokens). Running decodes go first (one token
each, so a long prompt never stalls them), then running prompts continue in chunks, then
waiting requests join in arrival order. When KV blocks run out, the youngest running sequence
is preempted: its blocks are freed and it is recomputed later (its tokens are kept).
A decode carrying draft tokens (speculation.py) is scheduled as 1 + drafts tokens when the budget
and the KV blocks allow, else as a plain decode (its drafts dropped, nobody preempted for them).

Requests waiting together are admitted in groups, not all into one step, when a step's fixed
cost is small next to their prompts (a CPU): with n waiting, each ~t uncached tokens, and a step
costing as much as F tokens beyond its own (`step_overhead_tokens`), g per step gets them their
first tokens after a summed n²F/2g + n·g·t/2 (+ terms free of g), least at g = sqrt(nF/t): a
step admits new requests until it holds sqrt(n·F·t) prompt tokens (at least one request).
Why: admitted all at once, clients that hit the prefix cache together went into one long step
per wave, all their first tokens after it, and finished in lockstep to arrive together again.
A burst of long prompts costs little either way, since from a few hundred tokens up a step's
cost per token no longer depends on its size (`python -m client bench prefix` and `bench
offline`; docs/decisions.md, "Requests waiting together are admitted in groups").

With prefix caching, a request joining the batch first shares the cached blocks of its longest
cached prefix (kv_manager.match_prefix) and computes only the rest, in chunks as usual; a
preempted sequence finds its own blocks again if they were not evicted meanwhile.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from backend.engine.buckets import BucketPlan
from backend.engine.kv_manager import KVCacheManager
from backend.engine.sequence import Sequence, Status


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]]  # (sequence, tokens to compute this step)
    preempted: list[Sequence]
    prefix_queries: int = 0  # tokens of the requests admitted this step (caching on)
    prefix_hits: int = 0  # ... of which served from the prefix cache

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 plan: BucketPlan | None = None, step_overhead_tokens: int = 0,
                 max_loras: int = 0):
        self.kv = kv
        self.plan = plan
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_overhead_tokens = step_overhead_tokens  # 0: no grouping
        self.max_loras = max_loras  # distinct LoRA adapters running at once (0: no cap)
        # Admission keeps a little headroom so running decodes rarely need to preempt.
        self.watermark = max(1, kv.num_blocks // 100) if kv.num_blocks > 8 else 0
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks (a forked sample) joins the running ones."""
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = Status.FINISHED

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        preempted: list[Sequence] = []
        queries = hits = 0
        prompt_tokens = 0  # prompt chunks in this step (prefills, recomputes; not drafts)
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        prefills = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_schedulable, budget)
            if n == 0:
                continue  # waits for its grammar
            if seq.draft_token_ids:  # a decode with drafts to verify: only if room is there
                want = n + len(seq.draft_token_ids)
                if want <= budget and self.kv.allocate(seq, seq.num_computed_tokens + want):
                    scheduled[seq] = want
                    budget -= want
                    continue
                seq.draft_token_ids = []
            while not self.kv.allocate(seq, seq.num_computed_tokens + n):
                victim = self._youngest_other(seq)
                self._preempt(victim)
                preempted.append(victim)
                budget += scheduled.pop(victim, 0)
                if victim is seq:
                    break
            else:
                scheduled[seq] = n
                budget -= n
                prompt_tokens += n if n > 1 else 0
        if not preempted:
            group_tokens = None
            loras = {s.lora_id for s in self.running if s.lora_id}
            # a parallel-sampling request not yet forked counts as its n samples
            occupied = sum(s.slots for s in self.running)
            for seq in list(self.waiting):  # each holds no blocks, has computed nothing
                if budget <= 0 or occupied + seq.slots > self.max_num_seqs:
                    break
                if group_tokens is not None and prompt_tokens >= group_tokens:
                    break
                if (self.max_loras and seq.lora_id and seq.lora_id not in loras
                        and len(loras) >= self.max_loras):
                    break  # FCFS: it waits for a running adapter's requests to finish
                prefix = self.kv.match_prefix(seq)  # never covers the prompt's last token
                cached = len(prefix) * self.kv.block_size
                n = min(seq.num_schedulable - cached, budget)
                if n <= 0:
                    continue  # its one uncached token waits for its grammar: the next may pass
                if group_tokens is None:  # the oldest waiting request stands for the rest
                    group_tokens = self._group_tokens(len(self.waiting), n)
                reserve = self.watermark if self.running else 0
                if not self.kv.allocate(seq, cached + n, reserve=reserve, prefix=prefix):
                    break  # FCFS: nobody overtakes the oldest waiting request
                self.waiting.remove(seq)
                seq.num_computed_tokens = cached
                if seq.num_cached_tokens is None:  # a recompute after preemption keeps the first
                    seq.num_cached_tokens = cached
                if self.kv.enable_caching:
                    queries += seq.num_tokens
                    hits += cached
                seq.status = Status.RUNNING
                occupied += seq.slots
                if seq.lora_id:
                    loras.add(seq.lora_id)
                bisect.insort(self.running, seq, key=lambda s: s.arrival)
                scheduled[seq] = n
                budget -= n
                prompt_tokens += n
        out = list(scheduled.items())
        if self.plan is not None:
            self._trim_to_bucket(out)
        return SchedulerOutput(out, preempted, queries, hits)

    def _group_tokens(self, num_waiting: int, tokens: int) -> float:
        """Prompt tokens a step admits new requests up to (see the module docstring)."""
        if not self.step_overhead_tokens:
            return float("inf")
        return math.sqrt(num_waiting * self.step_overhead_tokens * tokens)

    def _trim_to_bucket(self, out: list[tuple[Sequence, int]]) -> None:
        """Shorten the last prompt chunk so the step's token count is exactly a bucket: the
        tokens cut run next step, instead of this step computing padding."""
        chunks = [i for i, (s, n) in enumerate(out) if n > 1 and not s.draft_token_ids]
        if not chunks:
            return
        total = sum(n for _, n in out)
        target = self.plan.bucket_at_most(total)
        i = chunks[-1]
        seq, n = out[i]
        cut = total - target if target is not None else 0
        # A chunk that is all its sequence can run now (its prompt's end, or the end before a
        # token held back for its grammar) would need a step of its own for the cut tokens: a
        # whole step's latency before its first token. Padding up costs less when it computes
        # fewer wasted tokens than it would cut (255 tokens: 1 of padding vs 63 cut to 192),
        # or than a step of its own costs (step_overhead_tokens). Measured with `python -m
        # client bench structured` (docs/decisions.md, "A prompt's last chunk is padded").
        pad = self.plan.token_bucket(total) - total
        if n == seq.num_schedulable and pad <= max(cut, self.step_overhead_tokens):
            return
        if 0 < cut < n - 1:  # keep >= 2: still a chunk
            out[i] = (seq, n - cut)

    def _youngest_other(self, seq: Sequence) -> Sequence:
        """The preemption victim: the youngest running sequence younger than seq, else seq."""
        victim = self.running[-1]
        return victim if victim.arrival > seq.arrival else seq

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
