"""Greedy decoding without reading the whole float32 lm_head: exact tokens from half the bytes.

A batch-1 float32 decode step streams every weight once, and the lm_head (the tied embedding:
vocab x hidden) is a fifth of SmolLM2's. A row that only takes the argmax of its logits (greedy,
no logprobs, penalties, grammar or min_tokens: Sampler.argmax_only) needs one logit exactly, not
49,152. So the kernel (tpllm_kernels/csrc/cpu_gemv_bf16.cpp, greedy_argmax_screened) computes every
logit from a bf16 copy of the head, bounds each one's distance from the exact float32 logit,
and recomputes in float32 only the few whose bound reaches the best lower bound (SmolLM2: 1-9).
The token and its logit are bit for bit what the full head and argmax give, ties included.
Under TP each rank screens its vocabulary slice and rank 0 gathers one (token, logit) pair per
rank instead of the logits (ParallelLMHead.argmax_logits).

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

from backend.model import host_memory

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
            # in huge pages, as the weights (host_memory): every screened step streams it
            low = host_memory.zeros([tuple(weight.shape)], torch.bfloat16)[0].copy_(weight) \
                if weight.device.type == "cpu" else weight.to(torch.bfloat16)
            # in float64, a slice at a time (a whole float64 copy of a large head is 2x its size)
            row_norms = torch.cat([w.double().norm(dim=1).float() for w in weight.split(8192)])
        return cls(low, row_norms, screening_eps(weight.shape[1]), screened)

    def best(self, x: torch.Tensor, weight: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each row's argmax over `weight`'s rows and its exact logit (tokens -1 for a row that
        is not finite: the bound needs finite values); None where the kernel does not take x
        (more rows than its GEMV's). Which rows fail depends on x alone: under TP every rank
        (same x) fails the same ones."""
        got = self.screened(x, weight, self.low, self.row_norms, self.eps)
        if got is None:
            return None
        tokens, values, candidates = got
        self.rows += x.shape[0]
        self.candidates += int(candidates.sum())
        return tokens, values


def argmax_logits(tokens: torch.Tensor, values: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32: values[b] at tokens[b], -inf elsewhere (a -1 token's row: all -inf,
    for the caller to replace)."""
    out = np.full((tokens.shape[0], vocab), -np.inf, dtype=np.float32)
    ok = (tokens >= 0).numpy()
    out[np.flatnonzero(ok), tokens.numpy()[ok]] = values.numpy()[ok]
    return torch.from_numpy(out)


def pick_across_ranks(pairs: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's (global token, logit) per row, [B, 2 * world] in rank order (the vocabulary
    slices ascend with the rank) -> the row's argmax over the whole vocabulary: the highest
    logit, the lowest rank among equal ones (so the first index, as argmax)."""
    pairs = pairs.view(pairs.shape[0], world, 2)
    rank = pairs[..., 1].argmax(dim=1, keepdim=True)  # the first of equal maxima
    return pairs[..., 0].gather(1, rank)[:, 0].long(), pairs[..., 1].gather(1, rank)[:, 0]
