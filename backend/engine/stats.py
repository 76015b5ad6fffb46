"""Counters and timings the engine keeps about itself (offline stats, bench output, metrics)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    steps: int = 0
    scheduled_tokens: int = 0  # prompt + decode tokens run through the model
    sampled_tokens: int = 0  # tokens appended (accepted speculative drafts included)
    preemptions: int = 0
    finished_requests: int = 0
    model_seconds: float = 0.0  # scheduling + input prep + forward
    sample_seconds: float = 0.0  # sampling + detokenization + stop checks
    warmup_seconds: float = 0.0
    recoveries: int = 0  # tensor-parallel groups rebuilt after a worker died
    collective_seconds: float = 0.0  # part of model_seconds spent in TP collectives (rank 0)
    prefix_cache_queries: int = 0  # tokens of requests admitted with prefix caching on
    prefix_cache_hits: int = 0  # ... of which served from cached blocks (hit rate: the ratio)
    spec_draft_tokens: int = 0  # n-gram draft tokens verified (speculative decoding)
    spec_accepted_tokens: int = 0  # ... of which the model agreed with (appended for free)

    def record_step(self, tokens: int, sampled: int, model_s: float, sample_s: float,
                    preempted: int, collective_s: float = 0.0) -> None:
        self.steps += 1
        self.scheduled_tokens += tokens
        self.sampled_tokens += sampled
        self.model_seconds += model_s
        self.sample_seconds += sample_s
        self.preemptions += preempted
        self.collective_seconds += collective_s

    def snapshot(self) -> dict:
        return asdict(self)
