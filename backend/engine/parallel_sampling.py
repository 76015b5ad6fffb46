"""Parallel sampling (n > 1): n continuations of one prompt that share its prefill.

A request with n > 1 runs as one sequence (sample 0) until its prompt is computed. In the step
whose logits give its first token it forks: samples 1..n-1 take the same prompt, share its full
KV blocks (reference counts) and each get a copy of the last, partial block (copy-on-write: each
writes its own next tokens there; the copy runs on every rank before the next step's forward);
all n sample their first token from the same logits row. From then on they are ordinary
sequences (scheduled, preempted and recomputed one by one); the request ends when all n have.
With a seed s, sample i draws from a generator seeded s + i (vLLM's rule), so the n texts differ
and are reproducible, streamed or not.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backend.engine.kv_manager import KVCacheManager, NoFreeBlock
from backend.engine.outputs import RequestOutput, output_for
from backend.engine.scheduler import Scheduler
from backend.engine.sequence import Sequence, Status
from backend.model.greedy_head import GreedyPicks


@dataclass(eq=False)
class SampleGroup:
    """One n > 1 request's samples, in index order (sample 0 alone until the fork)."""
    request_id: str
    n: int
    samples: list[Sequence] = field(default_factory=list)

    @property
    def forked(self) -> bool:
        return len(self.samples) == self.n

    @property
    def done(self) -> bool:
        return self.forked and all(s.finish_reason is not None for s in self.samples)

    def live(self) -> list[Sequence]:
        return [s for s in self.samples if s.status is not Status.FINISHED]


def child_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed (vLLM's seed + index), kept within a generator's 64 bits."""
    return None if seed is None else (seed + index) % 2**64


def merged_output(group: SampleGroup, parts: dict[int, RequestOutput]) -> RequestOutput:
    """This step's update of a group request: every sample's delta at its index (an empty one
    for a sample with nothing new), finished once all n are."""
    samples = [parts.get(s.index) or output_for(s, "", []) for s in group.samples]
    first = group.samples[0]
    done = group.done
    reasons = [s.finish_reason for s in group.samples]
    out = RequestOutput(
        request_id=group.request_id, text="", token_ids=[], finished=done,
        finish_reason=("length" if "length" in reasons else "stop") if done else None,
        num_input_tokens=first.num_prompt_tokens,
        num_output_tokens=sum(s.num_output_tokens for s in group.samples),
        num_cached_tokens=first.num_cached_tokens or 0, samples=samples)
    if done:
        out.metrics = output_for(first, "", []).metrics
    return out


def fork_samples(parent: Sequence, new_sample: Callable[[Sequence, int], Sequence],
                 kv: KVCacheManager, scheduler: Scheduler
                 ) -> tuple[list[Sequence], list[tuple[int, int]]]:
    """Samples 1..n-1 of parent's request, sharing its prompt's blocks and running (or, with no
    block free for the partial block's copy, waiting to recompute the prompt as a preempted
    sequence would); the (source, copy) block pairs to copy before the next forward."""
    group, prompt = parent.group, parent.num_prompt_tokens
    children, copies = [], []
    for index in range(1, group.n):
        child = new_sample(parent, index)
        group.samples.append(child)
        children.append(child)
        try:
            pair = kv.fork(parent, child, prompt)
        except NoFreeBlock:
            scheduler.add(child)
            continue
        child.num_computed_tokens = prompt  # once this step's forward has run
        scheduler.add_running(child)
        if pair is not None:
            copies.append(pair)
    return children, copies


def fork_rows(sampling: list[Sequence], new_sample: Callable[[Sequence, int], Sequence],
              kv: KVCacheManager, scheduler: Scheduler
              ) -> tuple[list[Sequence], list[int], list[tuple[int, int]]]:
    """Fork the requests whose first token this step samples: the rows to sample (each fork's
    samples right after it), the logits row of each, and the block copies to make."""
    rows, src, copies, i = [], [], [], 0
    for seq in sampling:
        n = 1 + len(seq.draft_token_ids)  # a verified sequence owns 1 + drafts rows
        rows.append(seq)
        src.extend(range(i, i + n))
        if seq.group is not None and not seq.group.forked:
            children, pairs = fork_samples(seq, new_sample, kv, scheduler)
            copies += pairs
            rows += children
            src += [i] * len(children)
        i += n
    return rows, src, copies


def take_rows(logits: torch.Tensor | GreedyPicks, rows: list[int]) -> torch.Tensor | GreedyPicks:
    """The logits (or greedy picks) of `rows`, a row repeated where it is listed again."""
    if isinstance(logits, GreedyPicks):
        return GreedyPicks([logits.tokens[r] for r in rows], [logits.values[r] for r in rows],
                           logits.vocab)
    return logits[torch.as_tensor(rows, device=logits.device)]
