"""Turns a batch of next-token logits into chosen token ids (the per-step hot path).

Order per row: grammar mask (structured output) -> penalties -> min_tokens masking -> greedy argmax, or temperature -> top-k -> top-p
-> min-p -> sample. Each stage only touches the rows that need it, so the common cases (all greedy,
or plain temperature sampling) cost one or two passes over the logits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch

from backend.engine.sampling import logprobs as lp_mod
from backend.engine.sampling.sampling_params import SamplingParams
from backend.model.greedy_head import GreedyPicks

# Below this temperature logits / T can overflow float32 and the distribution is a point mass on
# the argmax anyway (vLLM uses the same cutoff), so such rows are decoded greedily.
_GREEDY_EPS = 1e-5
_NEG_INF = float("-inf")


class SamplingRow(Protocol):
    params: SamplingParams
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int  # generated ids are token_ids[num_prompt_tokens:]
    generator: torch.Generator | None  # seeded when params.seed is set, else None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # log_softmax(raw logits)[chosen], or None where params.logprobs is False.
    logprobs: list[float | None]
    # The chosen token's rank and the top-k alternatives, where params.top_logprobs is set.
    position_logprobs: list[lp_mod.PositionLogprobs | None] = field(default_factory=list)


def make_generator(seed: int | None) -> torch.Generator | None:
    """The per-request generator a SamplingRow should carry for ``params.seed``."""
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed)


def _needs_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _unique_pairs(chunks: list[tuple[int, list[int]]], vocab: int, device: torch.device):
    """Distinct (row, token) pairs over all rows at once, with occurrence counts."""
    toks = torch.cat([torch.tensor(ids, dtype=torch.long) for _, ids in chunks])
    rows = torch.cat([torch.full((len(ids),), i, dtype=torch.long) for i, ids in chunks])
    ok = (toks >= 0) & (toks < vocab)  # ids outside the logits' vocab cannot be penalised
    keys, cnt = torch.unique(rows[ok] * vocab + toks[ok], return_counts=True)
    return (keys // vocab).to(device), (keys % vocab).to(device), cnt.to(device)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (HF, over prompt+output), then presence/frequency (OpenAI, over output only).

    Works in place on ``logits`` [B, V] and returns it. Only (row, token) pairs that occur are
    touched, so cost scales with sequence lengths rather than B * V.
    """
    vocab = logits.shape[-1]
    dev, dt = logits.device, logits.dtype
    rep = [(i, r.token_ids) for i, r in enumerate(rows)
           if r.params.repetition_penalty != 1.0 and r.token_ids]
    if rep:
        r_i, t_i, _ = _unique_pairs(rep, vocab, dev)
        pen = torch.tensor([r.params.repetition_penalty for r in rows], dtype=dt, device=dev)[r_i]
        vals = logits[r_i, t_i]
        logits[r_i, t_i] = torch.where(vals > 0, vals / pen, vals * pen)
    gen = [(i, r.token_ids[r.num_prompt_tokens:]) for i, r in enumerate(rows)
           if (r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0)
           and len(r.token_ids) > r.num_prompt_tokens]
    if gen:
        r_i, t_i, cnt = _unique_pairs(gen, vocab, dev)
        pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=dt, device=dev)[r_i]
        freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=dt, device=dev)[r_i]
        logits[r_i, t_i] = logits[r_i, t_i] - (pres + freq * cnt.to(dt))
    return logits


def _min_tokens_pending(r: SamplingRow) -> bool:
    return bool(r.params.min_tokens) and len(r.token_ids) - r.num_prompt_tokens < r.params.min_tokens


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow],
                     eos_token_ids: set[int] | frozenset[int]) -> torch.Tensor:
    """Forbid EOS and stop_token_ids while fewer than min_tokens tokens have been generated."""
    vocab = logits.shape[-1]
    r_i: list[int] = []
    t_i: list[int] = []
    for i, r in enumerate(rows):
        p = r.params
        if _min_tokens_pending(r):
            banned = [t for t in set(eos_token_ids).union(p.stop_token_ids) if 0 <= t < vocab]
            r_i += [i] * len(banned)
            t_i += banned
    if r_i:
        logits[r_i, t_i] = _NEG_INF
    return logits


def _on_active_rows(logits: torch.Tensor, active: torch.Tensor, fn) -> torch.Tensor:
    """Run ``fn(sub_logits, row_index)`` on the active rows only (no copy when all are active)."""
    if bool(active.all()):
        fn(logits, slice(None))
    elif bool(active.any()):
        idx = active.nonzero().squeeze(1)
        sub = logits[idx]
        fn(sub, idx)
        logits[idx] = sub
    return logits


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (ties with the k-th value survive); k <= 0 disables."""
    vocab = logits.shape[-1]
    k = k.to(device=logits.device, dtype=torch.long)

    def run(sub: torch.Tensor, idx) -> None:
        kk = k[idx].clamp(max=vocab)
        top = sub.topk(int(kk.max()), dim=-1).values  # one topk at the largest k, sorted desc
        sub.masked_fill_(sub < top.gather(1, (kk - 1).unsqueeze(1)), _NEG_INF)

    return _on_active_rows(logits, (k > 0) & (k < vocab), run)


# apply_top_p first tries this many most likely tokens and fully sorts only the rows whose
# cut-off falls outside them: a [B, V] sort costs ~10x a small topk on CPU.
_TOP_P_CANDIDATES = 256


def _top_p_drop(sub: torch.Tensor, probs: torch.Tensor, pp: torch.Tensor,
                m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p drop mask judged from the m most likely tokens, and which rows that decides exactly."""
    vocab = sub.shape[-1]
    if m >= vocab:
        vals, order = sub.sort(dim=-1, descending=True, stable=True)
    else:
        vals, order = sub.topk(m, dim=-1)
        # topk leaves tie order unspecified; use (value desc, index asc) like the stable full sort.
        order, perm = order.sort(dim=-1)
        vals, perm = vals.gather(1, perm).sort(dim=-1, descending=True, stable=True)
        order = order.gather(1, perm)
    cum = probs.gather(1, order).cumsum_(dim=-1)
    # Keep a token iff the mass ranked before it is < p; the top token is always kept.
    keep = torch.cat([torch.ones_like(cum[:, :1], dtype=torch.bool), cum[:, :-1] < pp], dim=1)
    drop = torch.ones_like(sub, dtype=torch.bool).scatter_(1, order, ~keep)
    if m >= vocab:
        return drop, torch.ones_like(pp, dtype=torch.bool).squeeze(1)
    # Exact iff the candidates ranked above the smallest candidate value already reach p: then
    # every token at or below that value (in or out of the candidates) is dropped either way.
    above = (vals > vals[:, -1:]).sum(dim=1, keepdim=True)
    decided = (above > 0) & (cum.gather(1, (above - 1).clamp_(min=0)) >= pp)
    return drop, decided.squeeze(1)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches p; p == 1 disables.

    A token survives iff the mass of the tokens ranked before it (stable order on ties) is < p.
    """
    p = p.to(device=logits.device, dtype=logits.dtype)

    def run(sub: torch.Tensor, idx) -> None:
        pp = p[idx].unsqueeze(1)
        probs = sub.softmax(dim=-1)
        drop, ok = _top_p_drop(sub, probs, pp, _TOP_P_CANDIDATES)
        if not bool(ok.all()):
            bad = (~ok).nonzero().squeeze(1)
            drop[bad] = _top_p_drop(sub[bad], probs[bad], pp[bad], sub.shape[-1])[0]
        sub.masked_fill_(drop, _NEG_INF)

    return _on_active_rows(logits, p < 1.0, run)


def apply_min_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (the row's top probability); 0 disables."""
    p = p.to(device=logits.device, dtype=logits.dtype)

    def run(sub: torch.Tensor, idx) -> None:
        probs = sub.softmax(dim=-1)
        thresh = probs.amax(dim=-1, keepdim=True) * p[idx].unsqueeze(1)
        sub.masked_fill_(probs < thresh, _NEG_INF)

    return _on_active_rows(logits, p > 0.0, run)


class LogitsMask(Protocol):
    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None: ...


class Sampler:
    def __init__(self, eos_token_ids: set[int] | frozenset[int], seed: int | None = None,
                 mask: LogitsMask | None = None) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        # Structured output (backend/engine/sampling/guided.py): masks constrained rows in place first.
        self.mask = mask
        # Unseeded rows draw from here; randomly seeded so restarts do not repeat the same "random"
        # outputs (torch.Generator() alone always starts from the same fixed seed).
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def argmax_only(self, rows: Sequence[SamplingRow]) -> bool:
        """Whether every row takes the argmax of its raw logits and nothing else reads them:
        greedy, no logprobs, penalties or grammar, min_tokens reached. The model may then give
        each row its maximum alone (backend/model/greedy_head.py)."""
        return bool(rows) and all(
            r.params.temperature < _GREEDY_EPS and not r.params.logprobs
            and r.params.top_logprobs is None and not _needs_penalties(r.params)
            and getattr(r, "guided", None) is None and not _min_tokens_pending(r)
            for r in rows)

    def __call__(self, logits: torch.Tensor | GreedyPicks, rows: Sequence[SamplingRow]
                 ) -> SamplerOutput:
        """Pick one token per row. ``logits`` [B, V] float32 is modified in place; GreedyPicks
        (the model's answer to a step whose rows are all argmax_only) already hold the tokens."""
        if isinstance(logits, GreedyPicks):
            if len(logits.tokens) != len(rows):
                raise ValueError(f"{len(logits.tokens)} greedy picks for {len(rows)} rows")
            none = [None] * len(rows)
            return SamplerOutput(token_ids=list(logits.tokens), logprobs=none,
                                 position_logprobs=list(none))
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows), V], got {tuple(logits.shape)}")
        params = [r.params for r in rows]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs]
        raw = _copy_rows(logits, lp_rows) if lp_rows else None  # a copy: logits get edited

        if self.mask is not None:  # before penalties, temperature and filters; logprobs stay raw
            self.mask.apply(logits, rows)
        if any(_needs_penalties(p) for p in params):
            apply_penalties(logits, rows)
        apply_min_tokens(logits, rows, self.eos_token_ids)

        greedy = [p.temperature < _GREEDY_EPS for p in params]
        if all(greedy):
            tokens = argmax_rows(logits)
        else:
            tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            g_idx = [i for i, g in enumerate(greedy) if g]
            r_idx = [i for i, g in enumerate(greedy) if not g]
            if g_idx:
                tokens[g_idx] = argmax_rows(_copy_rows(logits, g_idx))
            x = logits[r_idx] if g_idx else logits
            tokens[r_idx] = self._sample(x, [rows[i] for i in r_idx])
        out = tokens.tolist()

        logprobs: list[float | None] = [None] * len(rows)
        positions: list[lp_mod.PositionLogprobs | None] = [None] * len(rows)
        if raw is not None:
            lsm = log_softmax_rows(raw)
            chosen = tokens[lp_rows].unsqueeze(1)
            for i, v in zip(lp_rows, lsm.gather(1, chosen).squeeze(1).tolist()):
                logprobs[i] = v
            top = [j for j, i in enumerate(lp_rows) if params[i].top_logprobs is not None]
            if top:
                rows_top = [lp_rows[j] for j in top]
                for i, pos in zip(rows_top, lp_mod.compute(
                        _copy_rows(lsm, top), tokens[rows_top],
                        [params[i].top_logprobs for i in rows_top])):
                    positions[i] = pos
        return SamplerOutput(token_ids=out, logprobs=logprobs, position_logprobs=positions)

    def _sample(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Temperature, filters, then inverse-CDF sampling with one uniform per row."""
        params = [r.params for r in rows]
        dev, dt = x.device, x.dtype
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            x.div_(torch.tensor(temps, dtype=dt, device=dev).unsqueeze(1))
        if any(p.top_k > 0 for p in params):
            apply_top_k(x, torch.tensor([p.top_k for p in params], device=dev))
        if any(p.top_p < 1.0 for p in params):  # the only stage that sorts
            apply_top_p(x, torch.tensor([p.top_p for p in params], dtype=dt, device=dev))
        if any(p.min_p > 0.0 for p in params):
            apply_min_p(x, torch.tensor([p.min_p for p in params], dtype=dt, device=dev))

        # Each row's uniform comes from its own generator, and softmax/cumsum/searchsorted are
        # row-independent, so a seeded row's draw does not depend on its batch neighbours.
        n_shared = sum(r.generator is None for r in rows)
        shared = iter(torch.rand(n_shared, generator=self._generator).tolist())
        u = [next(shared) if r.generator is None
             else torch.rand(1, generator=r.generator, device=r.generator.device).item()
             for r in rows]
        cdf = x.softmax(dim=-1).cumsum_(dim=-1)
        total = cdf[:, -1:]
        # Keep the target strictly below the total so `right=True` lands on a token with p > 0.
        target = torch.minimum(torch.tensor(u, dtype=dt, device=dev).unsqueeze(1) * total,
                               torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=x.shape[-1] - 1)


def _copy_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows], copied. On CPU by numpy, in this thread: torch's advanced-indexing copy of a
    49152-token row opens an OpenMP region, after which libgomp's worker kept spinning into the
    next decode step on the core the kernels' team needs: asking for logprobs then slowed every
    decode step, and moving log_softmax alone to numpy did not help; with this copy too it costs
    nothing measurable (docs/decisions.md, "Logprobs and greedy argmax in numpy")."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits[rows]
    return torch.from_numpy(logits.numpy()[rows])


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) (the first of equal maxima; NaN counts as the maximum, as in
    torch); on CPU in numpy, for _copy_rows' reason: torch splits a reduction over several
    rows across OpenMP threads, and libgomp's spinning after it showed up in profiles of
    speculative decoding's verify steps (docs/decisions.md)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.numpy().argmax(axis=-1))


def log_softmax_rows(raw: torch.Tensor) -> torch.Tensor:
    """raw.log_softmax(dim=-1); on CPU in numpy, for _copy_rows' reason."""
    if raw.device.type != "cpu" or raw.dtype != torch.float32:
        return raw.log_softmax(dim=-1)
    x = raw.numpy()
    top = x.max(axis=1, keepdims=True)
    return torch.from_numpy(x - (top + np.log(np.exp(x - top).sum(axis=1, keepdims=True))))
