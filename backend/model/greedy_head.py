"""Greedy decoding without reading the whole float32 lm_head: exact tokens from half the bytes.

A batch-1 float32 decode step streams every weight once, and the lm_head (the tied embedding:
vocab x hidden) is a fifth of SmolLM2's. A row that only takes the argmax of its logits (greedy,
no logprobs, penalties, grammar or min_tokens: Sampler.argmax_only) needs one logit exactly, not
49,152. So the kernel (kernels/csrc/cpu_gemv_bf16.cpp, greedy_argmax_screened) computes every
logit from a bf16 copy of the head, bounds each one's distance from the exact float32 logit,
and recomputes in float32 only the few whose bound reaches the best lower bound (SmolLM2: 1-9).
The token and its logit are bit for bit what the full head and argmax give, ties included.

The bound: with u = 2^-8 (bf16's unit roundoff) and x rounded to bf16 too (AVX512-BF16),
|approx_n - exact_n| <= (2u + u^2 + 2 K 2^-24) * sum_k |x_k w_nk| <= eps |x| |w_n|
(Cauchy-Schwarz; K 2^-24 bounds each float32 sum of K products; 5% on top covers the
norms' own roundings). Costs a second copy of the head in bf16 (SmolLM2: 57 MB).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import numpy as np
import torch

_BF16_UNIT_ROUNDOFF = 2.0 ** -8
_F32_UNIT_ROUNDOFF = 2.0 ** -24


def screening_eps(hidden: int) -> float:
    """eps of the bound above for rows of `hidden` inputs."""
    u = _BF16_UNIT_ROUNDOFF
    return 1.05 * (2 * u + u * u + 2.2 * hidden * _F32_UNIT_ROUNDOFF)


@dataclass
class GreedyScreen:
    low: torch.Tensor  # [V, K] bfloat16 copy of the head
    row_norms: torch.Tensor  # [V] float32 |w_n|
    eps: float
    screened: Callable  # ops.greedy_argmax_screened
    rows: int = 0  # rows screened so far
    candidates: int = 0  # of them, logits recomputed in float32

    @classmethod
    def build(cls, weight: torch.Tensor, ops: ModuleType) -> "GreedyScreen | None":
        """None where the kernels cannot screen this head (not float32, no bf16 GEMV) or the
        bound cannot hold (a weight that is not finite)."""
        screened = getattr(ops, "greedy_argmax_screened", None)
        supported = getattr(ops, "greedy_screen_supported", lambda w: False)
        if screened is None or weight.dtype != torch.float32 or not supported(weight):
            return None
        with torch.inference_mode():
            if not bool(torch.isfinite(weight).all()):
                return None
            low = weight.to(torch.bfloat16)
            # in float64, a slice at a time (a whole float64 copy of a large head is 2x its size)
            row_norms = torch.cat([w.double().norm(dim=1).float() for w in weight.split(8192)])
        return cls(low, row_norms, screening_eps(weight.shape[1]), screened)

    def argmax_logits(self, x: torch.Tensor, weight: torch.Tensor,
                      full: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """[B, V]: each row's exact maximum logit at its argmax, -inf elsewhere; a row the
        screen cannot take (not finite, or more rows than the kernel's) is `full(x)`'s."""
        got = self.screened(x, weight, self.low, self.row_norms, self.eps)
        if got is None:
            return full(x)
        tokens, values, candidates = got
        self.rows += x.shape[0]
        self.candidates += int(candidates.sum())
        out = np.full((x.shape[0], weight.shape[0]), -np.inf, dtype=np.float32)
        rows = np.arange(x.shape[0])
        out[rows, tokens.numpy()] = values.numpy()  # a -1 token writes the last column...
        logits = torch.from_numpy(out)
        for r in (tokens < 0).nonzero().flatten().tolist():  # ...then replaced by the full row
            logits[r] = full(x[r:r + 1])[0]
        return logits
