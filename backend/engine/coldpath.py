"""Counts work that should only ever happen before READY: a step shape never warmed, a compile,
a CUDA-graph capture, an autotune, a memory pool growing. Zero is the steady-state value."""
from __future__ import annotations

import logging
import threading
from collections import Counter

log = logging.getLogger("backend.engine")


class ColdPathCounter:
    def __init__(self):
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.ready = False  # set once warmup is done; only later events count

    def record(self, kind: str, detail: str = "") -> None:
        if not self.ready:
            return
        with self._lock:
            self._counts[kind] += 1
        log.warning("cold path after READY: %s %s", kind, detail)

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
