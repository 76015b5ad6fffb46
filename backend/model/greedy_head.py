"""Greedy decoding without reading the whole float32 lm_head: exact tokens, a fraction of the bytes.

A batch-1 float32 decode step streams every weight once, and the lm_head (the tied embedding:
vocab x hidden) is a fifth of SmolLM2's. A row that only takes the argmax of its logits (greedy,
no logprobs, penalties, grammar or min_tokens: Sampler.argmax_only) needs one logit exactly, not
49,152. So the kernel (tpllm_kernels/csrc/cpu_gemv_bf16.cpp) computes every logit from a low-
precision copy of the head, bounds each one's distance from the exact float32 logit, and
recomputes in float32 only the few whose bound reaches the best lower bound (SmolLM2: 1-9).
The token and its logit are bit for bit what the full head and argmax give, ties included.
Under TP each rank screens its vocabulary slice and rank 0 gathers one (token, logit) pair per
rank instead of the logits (ParallelLMHead.argmax_logits).

Two copies, by what the hidden size allows:
- "q8" (hidden a multiple of 32): int8 in groups of 32 along the row, a float32 scale each,
  1.125 bytes a weight (SmolLM2: 32 MB). x is quantized the same way at each step and the
  kernel sums integer products (csrc/q8_head_screen.cpp). The bound is per row and measured,
  not assumed: with x' the dequantized x,
    |approx_n - exact_n| <= max(|x|, |x'|) coef_n + 1.05 |x - x'| |wq_n|,
    coef_n = 1.05 (e_n + g |wq_n|),
  e_n = |w_n - q_n s_n| computed in float64 at load (SmolLM2's head came from a GGUF whose
  blocks are exactly such groups: e_n = 0), wq_n = q_n s_n, g = 2.2 K 2^-24 for the float32
  sums (both the screen's and the exact logit's), and |x - x'|, |x'| measured in float64 each
  step; the 5% covers the norms' own roundings.
- "bf16": 2 bytes a weight (57 MB). With u = 2^-8 and x rounded to bf16 too (AVX512-BF16),
  |approx_n - exact_n| <= (2u + u^2 + 2 K 2^-24) * sum_k |x_k w_nk| <= eps |x| |w_n|.
The bf16 kernel takes coef[n] with |approx_n - exact_n| <= |x| coef[n]; the q8 kernel coef and
the norms |wq_n| (wq_norm).
A bf16 head (dtype="bfloat16") gets the q8 copy too (0.56x its bytes), for the batches whose
logits the bf16 GEMV computes (1-2 rows): those logits are float32 sums rounded to bf16, so the
candidates are every row whose sum can round to the best lower bound's bf16 value or above (g
counts the exact sum's own rounding once more), and the first of the largest rounded wins.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from backend.model import host_memory

_BF16_UNIT_ROUNDOFF = 2.0 ** -8
_F32_UNIT_ROUNDOFF = 2.0 ** -24


Q8_GROUP = 32  # weights per int8 scale (csrc greedy_argmax_screened_q8)
_SLICE_ROWS = 8192  # float64 work a slice of the head at a time (a whole copy is 2x its size)


def _sum_rounding(hidden: int) -> float:
    """Relative bound of a float32 sum of `hidden` products (any order, fused or not)."""
    return 2.2 * hidden * _F32_UNIT_ROUNDOFF


def screening_eps(hidden: int) -> float:
    """The bf16 copy's eps (above) for rows of `hidden` inputs."""
    u = _BF16_UNIT_ROUNDOFF
    return 1.05 * (2 * u + u * u + _sum_rounding(hidden))


def _host_zeros(shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    # in huge pages, as the weights (host_memory): every screened step streams it
    if like.device.type == "cpu":
        return host_memory.zeros([shape], dtype)[0]
    return torch.zeros(shape, dtype=dtype, device=like.device)


def q8_copy(weight: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [V, K], scales float32 [V, K / Q8_GROUP], coef float32 [V], wq_norm float32 [V])
    of a float32 or bf16 head: each group's scale is its largest magnitude / 127 (rounded to
    float32; q is the nearest integer to w / scale, clamped to +-127), coef the row's bound
    factor (module doc; a bf16 head's own float32 sum rounds too: g |w_n| more) and wq_norm the
    norm of the row q * scales, both rounded up to float32.
    A head with an exact int8 block copy (tpllm_kernels/cpu_blocks.py: the GEMV reads it for
    the full logits) shares its q and scales, the ones computed here (e_n = 0), unless a code
    is -128: the kernel negates codes, so that head gets a copy of its own."""
    v, k = weight.shape
    groups = k // Q8_GROUP
    copy = getattr(weight, "block_copy", None)
    exact = copy[1:] if copy is not None and copy[0] == "q8" else None
    if exact and int(exact[0].min()) < -127:
        exact = None
    q = exact[0] if exact else _host_zeros((v, k), torch.int8, weight)
    scales = exact[1] if exact else _host_zeros((v, groups), torch.float32, weight)
    coef = torch.empty(v, dtype=torch.float32)
    wq_norm = torch.empty(v, dtype=torch.float32)
    g = _sum_rounding(k)
    up = torch.tensor(float("inf"))
    for start in range(0, v, _SLICE_ROWS):
        w = weight[start:start + _SLICE_ROWS].double().view(-1, groups, Q8_GROUP)
        rows = slice(start, start + w.shape[0])
        if exact:
            s, qq = scales[rows].double(), q[rows].double().view(-1, groups, Q8_GROUP)
        else:
            s = (w.abs().amax(dim=2) / 127).float().double()  # what the kernel multiplies by
            qq = torch.where(s[..., None] > 0, torch.round(w / s[..., None].clamp_min(1e-300)),
                             torch.zeros((), dtype=torch.float64)).clamp_(-127, 127)
        wq = qq * s[..., None]  # exact in float64: 8-bit integers times float32 scales
        err = (w - wq).flatten(1).norm(dim=1)
        norm = wq.flatten(1).norm(dim=1)
        bound = 1.05 * (err + g * norm)
        if weight.dtype == torch.bfloat16:  # the exact logit is itself a float32 sum
            bound += 1.05 * g * w.flatten(1).norm(dim=1)
        if not exact:
            q[rows] = qq.flatten(1).to(torch.int8)
            scales[rows] = s.float()
        coef[rows] = torch.nextafter(bound.float(), up)
        wq_norm[rows] = torch.nextafter(norm.float(), up)
    return q, scales, coef, wq_norm


@dataclass
class GreedyScreen:
    kind: str  # "q8" or "bf16" (module doc)
    copies: tuple[torch.Tensor, ...]  # the kernel's arguments after (x, weight)
    screened: Callable  # ops.greedy_argmax_screened_q8 or ops.greedy_argmax_screened
    max_rows: int = 0  # best() screens steps of at most this many rows (0: any the kernel takes)
    rows: int = 0  # rows screened so far
    candidates: int = 0  # of them, logits recomputed in float32

    @classmethod
    def build(cls, weight: torch.Tensor, ops: ModuleType, kind: str | None = None
              ) -> "GreedyScreen | None":
        """The screen of this head: `kind`, or q8 where the hidden size takes it, else bf16.
        None where the kernels cannot screen this head (neither float32 nor bf16, no GEMV for
        the copy, a bf16 copy of a bf16 head) or the bound cannot hold (a weight that is not
        finite)."""
        supported = getattr(ops, "greedy_screen_supported", lambda w: False)
        if weight.dtype not in (torch.float32, torch.bfloat16) or not supported(weight):
            return None
        q8 = getattr(ops, "greedy_argmax_screened_q8", None)
        if kind is None:
            kind = "q8" if q8 is not None and weight.shape[1] % Q8_GROUP == 0 else "bf16"
        if weight.dtype == torch.bfloat16 and kind != "q8":  # a bf16 copy saves nothing
            return None
        screened = q8 if kind == "q8" else getattr(ops, "greedy_argmax_screened", None)
        if screened is None or (kind == "q8" and weight.shape[1] % Q8_GROUP):
            return None
        with torch.inference_mode():
            if not bool(torch.isfinite(weight).all()):
                return None
            if kind == "q8":
                return cls(kind, q8_copy(weight), screened,
                           max_rows=getattr(ops, "Q8_SCREEN_INPUTS", 0))
            low = _host_zeros(tuple(weight.shape), torch.bfloat16, weight).copy_(weight)
            eps = screening_eps(weight.shape[1])
            coef = torch.cat([(w.double().norm(dim=1) * eps).float()
                              for w in weight.split(_SLICE_ROWS)])
            coef = torch.nextafter(coef, torch.tensor(float("inf")))  # rounded up
            return cls(kind, (low, coef), screened)

    def screen(self, x: torch.Tensor, weight: torch.Tensor):
        """The kernel's (tokens, logits, candidates), or None where it does not take x."""
        return self.screened(x, weight, *self.copies)

    def best(self, x: torch.Tensor, weight: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each row's argmax over `weight`'s rows and its exact logit (tokens -1 for a row that
        is not finite: the bound needs finite values); None where the kernel does not take x
        (more rows than its GEMV's) or x has more than max_rows rows. Which rows fail depends
        on x alone: under TP every rank (same x) fails the same ones.

        Why q8 stops at max_rows (one pass of its kernel over the head: 8 rows on AVX-512, 4 on
        AVX2): each further pass reads the head again, and the full head in float32 from its
        block copy (linear, then argmax) is then as fast or faster, with the same token and
        logit (docs/decisions.md, "The greedy lm_head screen reads an int8 copy"). (The bf16
        copy's kernel was faster than linear at every row count measured: no cap.)"""
        if self.max_rows and x.shape[0] > self.max_rows:
            return None
        got = self.screen(x, weight)
        if got is None:
            return None
        tokens, values, candidates = got
        self.rows += x.shape[0]
        self.candidates += sum(candidates.tolist())  # a list: fewer cycles than a tensor op
        return tokens, values


@dataclass
class GreedyPicks:
    """What a step whose rows all take the argmax gets instead of logits [B, V]: each row's
    token (the first of equal maxima; NaN counts as the maximum, as in torch's argmax) and its
    logit, bit for bit the full head's. No [B, V] array is filled with -inf for the sampler to
    search again: that and the torch ops around it cost a batch-1 decode step more than their
    arithmetic, the step having streamed the caches cold (`bench step-parts`: head, sampling,
    Python)."""
    tokens: list[int]
    values: list[float]  # float32 values (exact as Python floats)
    vocab: int

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.tokens), self.vocab)


def pick_across_ranks(pairs: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's (global token, logit) per row, [B, 2 * world] in rank order (the vocabulary
    slices ascend with the rank) -> the row's argmax over the whole vocabulary: the highest
    logit, the lowest rank among equal ones (so the first index, as argmax)."""
    pairs = pairs.view(pairs.shape[0], world, 2)
    rank = pairs[..., 1].argmax(dim=1, keepdim=True)  # the first of equal maxima
    return pairs[..., 0].gather(1, rank)[:, 0].long(), pairs[..., 1].gather(1, rank)[:, 0]
