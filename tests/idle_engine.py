"""The parts of an LLMEngine that backend.triton.metrics.engine_snapshot reads, idle (nothing
running or waiting, no KV block used), around a given EngineStats."""
from __future__ import annotations

from types import SimpleNamespace

from backend.engine.stats import EngineStats


def idle_engine(stats: EngineStats) -> SimpleNamespace:
    return SimpleNamespace(scheduler=SimpleNamespace(running=[], waiting=[]),
                           kv=SimpleNamespace(num_used_blocks=0, num_blocks=8), stats=stats)
