"""Tensor-parallel building blocks. With one rank they reduce to plain linears and lookups.

Each parameter carries a ``shards`` map: checkpoint shard id -> (dim, src_start, src_end,
dst_offset), i.e. which slice of the full checkpoint tensor this rank reads and where it goes.
The loader reads only those slices, so a rank never materialises another rank's weights.
"""
from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from backend.model.greedy_head import GreedyPicks, GreedyScreen, pick_across_ranks
from backend.parallel.context import ParallelContext
from backend.parallel.partition import split_range
from tpllm_kernels import reference

ShardMap = dict[str | None, tuple[int, int, int, int]]


class DirectModule(nn.Module):
    """An nn.Module whose call is its forward: no hook dispatch. A batch-1 decode step makes ~300
    module calls and torch's hook-aware __call__ costs a few microseconds each; the model
    registers no hooks."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward


def sharded_param(shape: tuple[int, ...], dtype: torch.dtype, shards: ShardMap) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.shards = shards  # type: ignore[attr-defined]
    return p


def _linear_for(ops: ModuleType, x: torch.Tensor, weight: torch.Tensor,
                slot: Callable[[int, int, torch.dtype], torch.Tensor | None]) -> torch.Tensor:
    """x @ weight^T for a collective: computed straight into the slot `slot(rows, cols, dtype)`
    offers (shared memory the collective then posts without a copy) when the kernels can write
    into one (ops.linear_into) and it does, else anywhere."""
    into = getattr(ops, "linear_into", None)
    out = slot(x.shape[0], weight.shape[0], x.dtype) if into is not None and x.dim() == 2 else None
    return ops.linear(x, weight) if out is None else into(x, weight, out)


class ColumnParallelLinear(DirectModule):
    """Output features split across ranks. `rows` names each merged checkpoint tensor (q/k/v,
    gate/up) and the [start, end) of its output rows this rank owns; they are stacked in order."""

    lora = None  # LoRA adapters' deltas (lora_layers.LoraSlot), where an adapter targets it

    def __init__(self, in_features: int, rows: dict[str | None, tuple[int, int]], bias: bool,
                 dtype: torch.dtype, ops: ModuleType = reference):
        super().__init__()
        self.ops = ops
        offsets, off = {}, 0
        for sid, (s, e) in rows.items():
            offsets[sid] = (0, s, e, off)
            off += e - s
        self.out_sizes = [e - s for s, e in rows.values()]
        self.weight = sharded_param((off, in_features), dtype, offsets)
        self.bias = sharded_param((off,), dtype, offsets) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.add(x, y)


class RowParallelLinear(DirectModule):
    """Input features split across ranks; partial sums are all-reduced (the layer's collective)."""

    lora = None  # as ColumnParallelLinear's; its deltas join the partial sum before the reduce

    def __init__(self, in_range: tuple[int, int], out_features: int, bias: bool,
                 dtype: torch.dtype, ctx: ParallelContext, ops: ModuleType = reference):
        super().__init__()
        s, e = in_range
        self.ctx, self.ops = ctx, ops
        self.weight = sharded_param((out_features, e - s), dtype, {None: (1, s, e, 0)})
        self.bias = sharded_param((out_features,), dtype,
                                  {None: (0, 0, out_features, 0)}) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = _linear_for(self.ops, x, self.weight, self.ctx.reduce_slot)
        return self.reduce(partial if self.lora is None else self.lora.add(x, partial))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's partial product -> the layer's output: all-reduce, then the bias."""
        return self.finish(partial, False, 0.0, None)

    def finish(self, out: torch.Tensor, arrived: bool, seconds: float,
               collective: tuple | None) -> torch.Tensor:
        """The output from a fused decode kernel's (out, arrived, seconds) for `collective`
        (ParallelContext.fused_collective; None: out is the unreduced partial)."""
        y = (self.ctx.all_reduce(out) if collective is None
             else self.ctx.finish_fused(out, arrived, seconds, collective))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(DirectModule):
    """Each rank holds a contiguous slice of the vocabulary's rows."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.start, self.end = split_range(vocab_size, ctx.rank, ctx.world_size)
        self.weight = sharded_param((self.end - self.start, hidden), dtype,
                                    {None: (0, self.start, self.end, 0)})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.ctx.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(DirectModule):
    """Vocab-sharded logits, gathered to the full vocabulary on rank 0 (float32 for the sampler);
    other ranks return None."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, ctx: ParallelContext,
                 tied: VocabParallelEmbedding | None = None, ops: ModuleType = reference,
                 softcap: float = 0.0):
        super().__init__()
        self.ctx, self.ops = ctx, ops
        self.softcap = softcap  # Gemma 2's final logit soft-capping (0: none)
        self.shard_sizes = [e - s for s, e in (split_range(vocab_size, r, ctx.world_size)
                                               for r in range(ctx.world_size))]
        if tied is not None:
            self.weight = tied.weight
        else:
            s, e = split_range(vocab_size, ctx.rank, ctx.world_size)
            self.weight = sharded_param((e - s, hidden), dtype, {None: (0, s, e, 0)})

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        local = _linear_for(self.ops, x, self.weight, self.ctx.gather_slot)
        logits = self.ctx.gather_first(local, self.shard_sizes)
        if logits is None:
            return None
        logits = logits.float()
        return self.ops.soft_cap(logits, self.softcap) if self.softcap else logits

    # Greedy steps without reading the whole float32 head (see greedy_head.py).
    screen: GreedyScreen | None = None

    def enable_greedy_screening(self) -> bool:
        """Keep what argmax_logits needs (an int8 copy of the weight in groups of 32, 0.28x its
        bytes again; bf16 where the hidden size is not a multiple of 32, 0.5x), if the kernels
        can (a float32 head, or a bf16 one with the int8 copy). Returns whether it is on.
        Never under a final soft cap: two raw logits the cap rounds to one float32 value tie
        after it, and the first of them wins transformers' argmax, which the screen's raw
        argmax need not be."""
        self.screen = None if self.softcap else GreedyScreen.build(self.weight, self.ops)
        return self.screen is not None

    def argmax_logits(self, x: torch.Tensor) -> GreedyPicks | torch.Tensor | None:
        """For rows that only take the argmax: each row's token and logit, bit for bit self(x)
        + argmax's (the first of equal maxima), as GreedyPicks (rank 0; other ranks None);
        the logits where the screen does not take x (more rows than it screens at once).
        Under TP each rank screens its vocabulary slice and rank 0 takes the best of the ranks'
        (token, logit) pairs: every rank must screen the step (rank 0 asks for it only when all
        of them can: TPGroup.screening_everywhere)."""
        if self.screen is None:
            raise RuntimeError("argmax_logits: greedy screening is not enabled")
        got = self.screen.best(x, self.weight)
        if got is None:  # the same on every rank (same rows): logits, for the sampler's argmax
            return self(x)
        tokens, values = got
        # rows the screen handed back (not finite; the same rows on every rank): in full, every
        # rank taking part in each row's gather in the same order. (Lists: for a step's few
        # rows they cost less than tensor ops.)
        listed = tokens.tolist()
        full_rows = {r: self(x[r:r + 1]) for r, t in enumerate(listed) if t < 0}
        world = self.ctx.world_size
        if world > 1:
            start = sum(self.shard_sizes[:self.ctx.rank])
            token = torch.where(tokens >= 0, tokens + start, tokens).to(values.dtype)
            pairs = self.ctx.gather_first(torch.stack([token, values], dim=1), [2] * world)
            if pairs is None:  # not rank 0
                return None
            tokens, values = pick_across_ranks(pairs, world)
            listed = tokens.tolist()
        picks = GreedyPicks(listed, values.tolist(), sum(self.shard_sizes))
        for r, row in full_rows.items():  # the full row's argmax, NaN and all
            picks.tokens[r] = int(row[0].numpy().argmax())
            picks.values[r] = float(row[0, picks.tokens[r]])
        return picks


class RMSNorm(DirectModule):
    """rows: this rank's [start, end) of a weight split across ranks (OLMoE's norms of the
    whole q and k, which each rank applies to its heads' columns: WholeQKNorm); None: all."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, ops: ModuleType = reference,
                 rows: tuple[int, int] | None = None):
        super().__init__()
        self.eps = eps
        self.ops = ops
        s, e = rows if rows is not None else (0, hidden)
        self.weight = sharded_param((e - s,), dtype, {None: (0, s, e, 0)})

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class WholeQKNorm:
    """OLMoE's q and k norms: one RMSNorm over every query head's dims, one over every key
    head's (not per head). Under TP a rank holds some heads' columns: the sums of squares of
    the whole widths come from an all-reduce of each row's two partial sums ([rows, 2] float32),
    a KV head held by two ranks (GQA) counted by the first of them only."""

    def __init__(self, num_q: int, num_kv: int, head_dim: int, owned_kv: tuple[int, int],
                 widths: tuple[int, int], eps: float, ctx: ParallelContext):
        self.q_cols = num_q * head_dim
        self.k_cols = num_kv * head_dim
        # the local key columns whose squares this rank adds (its KV heads no lower rank holds)
        self.owned = slice(owned_kv[0] * head_dim, owned_kv[1] * head_dim)
        self.widths = torch.tensor(widths, dtype=torch.float32)  # on the model's device
        self.eps, self.ctx = eps, ctx

    def __call__(self, qkv: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor) -> torch.Tensor:
        """Normalizes q's and k's columns of qkv in place, as transformers' RMSNorm: float32
        statistics, the normalized values cast to the dtype, then times the weight."""
        q_end, k_end = self.q_cols, self.q_cols + self.k_cols
        q, k = qkv[:, :q_end].float(), qkv[:, q_end:k_end].float()
        sums = torch.stack([q.square().sum(-1), k[:, self.owned].square().sum(-1)], dim=1)
        sums = self.ctx.all_reduce(sums)
        inv = torch.rsqrt(sums / self.widths + self.eps)
        qkv[:, :q_end] = q_weight * (q * inv[:, :1]).to(qkv.dtype)
        qkv[:, q_end:k_end] = k_weight * (k * inv[:, 1:]).to(qkv.dtype)
        return qkv
