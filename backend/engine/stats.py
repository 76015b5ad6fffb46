"""Counters and timings the engine keeps about itself (offline stats, bench output, metrics)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class EngineStats:
    steps: int = 0
    scheduled_tokens: int = 0  # prompt + decode tokens run through the model
    sampled_tokens: int = 0
    preemptions: int = 0
    finished_requests: int = 0
    model_seconds: float = 0.0  # scheduling + input prep + forward
    sample_seconds: float = 0.0  # sampling + detokenization + stop checks
    warmup_seconds: float = 0.0
    recoveries: int = 0  # tensor-parallel groups rebuilt after a worker died
    collective_seconds: float = 0.0  # part of model_seconds spent in TP collectives (rank 0)
    ttft_seconds: list[float] = field(default_factory=list, repr=False)
    e2e_seconds: list[float] = field(default_factory=list, repr=False)

    def record_step(self, tokens: int, sampled: int, model_s: float, sample_s: float,
                    preempted: int, collective_s: float = 0.0) -> None:
        self.steps += 1
        self.scheduled_tokens += tokens
        self.sampled_tokens += sampled
        self.model_seconds += model_s
        self.sample_seconds += sample_s
        self.preemptions += preempted
        self.collective_seconds += collective_s

    def record_finish(self, seq) -> None:
        now = time.perf_counter()
        self.finished_requests += 1
        if seq.first_token_time is not None:
            self.ttft_seconds.append(seq.first_token_time - seq.arrival_time)
        self.e2e_seconds.append(now - seq.arrival_time)
        del self.ttft_seconds[:-10000], self.e2e_seconds[:-10000]  # bounded memory

    def snapshot(self) -> dict:
        d = asdict(self)
        d.pop("ttft_seconds"), d.pop("e2e_seconds")
        return d
