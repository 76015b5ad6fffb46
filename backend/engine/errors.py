"""Errors the engine raises to its callers that they answer in kind (kept free of heavy imports:
the Triton adapter imports this at module load, the engine itself only when it starts)."""
from __future__ import annotations


class EngineUnavailable(RuntimeError):
    """The engine takes no request now (shutting down, or a TP group across hosts being rebuilt):
    the caller's answer is "unavailable, retry", not an internal error."""
