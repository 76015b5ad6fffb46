"""Serving LoRA adapters in the model's projections, batched: a step's rows are grouped by
adapter and each group adds scale * (x @ A^T) @ B^T (a shrink to rank r, then an expand) to
the base layer's output. Nothing is merged into the base weights, so rows of different adapters
(and rows of none, which are left untouched) share one step.

Each linear that some adapter targets gets a LoraSlot holding, per adapter, this rank's
matrices sharded like the base weight: a column-parallel layer (q/k/v, gate/up) keeps A whole
and the rows of B its output rows are made of; a row-parallel one (o, down) keeps A's columns of
its input slice and B whole, and its delta joins the partial sum before the all-reduce. A merged
layer (qkv, gate_up) stacks its targets' A matrices ([n * r, in]) and places each B in its own
output rows and rank columns of one [out, n * r] matrix (zeros elsewhere: adding them changes no
value), so a group costs two matrix products per layer. The scale is folded into B. The products
run on the layer's own kernels (ops.linear: on CPU the C++ GEMV for a decode step's few rows,
where torch.mm's small GEMMs waited on waking OpenMP threads: 2 threads, [4, 576] x [576, 24]
took ~50x the C++ call's time under load).
"""
from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from backend.model.lora_adapter import LoraAdapter
from backend.model.layers import ColumnParallelLinear, RowParallelLinear

# our merged parameter's shard id -> PEFT's module name
_SID_MODULE = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "gate": "gate_proj", "up": "up_proj"}
Rows = slice | torch.Tensor  # a group's rows: a contiguous range, else their indices


class LoraRows:
    """The current step's row groups, shared by every LoraSlot of a model: (adapter id, rows).
    Empty for a step without adapter rows (the slots then add nothing)."""

    def __init__(self) -> None:
        self.groups: Sequence[tuple[int, Rows]] = ()


class LoraSlot:
    """One linear's adapters: weights[id] = (A [R, in_local], B [out_local, R]) or None."""

    def __init__(self, rows: LoraRows, num_adapters: int, ops: ModuleType):
        self.rows, self.ops = rows, ops
        self.weights: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * (num_adapters + 1)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's output for x, or its partial sum) plus each row's adapter delta,
        in place."""
        for aid, rows in self.rows.groups:
            w = self.weights[aid]
            if w is None:  # this adapter leaves this layer as it is
                continue
            a, b = w
            linear = self.ops.linear
            if isinstance(rows, slice):
                y[rows] += linear(linear(x[rows], a), b)
            else:
                y.index_add_(0, rows, linear(linear(x.index_select(0, rows), a), b))
        return y


def attach_adapters(model, adapters: Sequence[LoraAdapter]) -> LoraRows | None:
    """Give every targeted linear of `model` (LlamaForCausalLM) a LoraSlot with this rank's
    shards of `adapters` (ids 1..len(adapters), in order); returns the rows holder the model
    sets per step (None: no adapters)."""
    if not adapters:
        return None
    rows = LoraRows()
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.qkv_proj, mlp.gate_up_proj):
            _attach_column(linear, i, adapters, rows)
        _attach_row(attn.o_proj, i, "o_proj", adapters, rows)
        _attach_row(mlp.down_proj, i, "down_proj", adapters, rows)
    return rows


def _slot(linear, adapters: Sequence[LoraAdapter], rows: LoraRows) -> LoraSlot:
    if linear.lora is None:
        linear.lora = LoraSlot(rows, len(adapters), linear.ops)
    return linear.lora


def _attach_column(linear: ColumnParallelLinear, layer: int, adapters: Sequence[LoraAdapter],
                   rows: LoraRows) -> None:
    w = linear.weight
    for aid, adapter in enumerate(adapters, 1):
        parts = [(adapter.weights[(layer, _SID_MODULE[sid])], shard)
                 for sid, shard in w.shards.items() if (layer, _SID_MODULE[sid]) in adapter.weights]
        if not parts:
            continue
        r = adapter.rank
        a = torch.cat([a for (a, _), _ in parts])
        b = torch.zeros(w.shape[0], r * len(parts))
        for j, ((_, b_full), (_, start, end, offset)) in enumerate(parts):
            b[offset:offset + end - start, j * r:(j + 1) * r] = b_full[start:end] * adapter.scale
        _slot(linear, adapters, rows).weights[aid] = _placed(a, b, w)


def _attach_row(linear: RowParallelLinear, layer: int, module: str,
                adapters: Sequence[LoraAdapter], rows: LoraRows) -> None:
    w = linear.weight
    _, start, end, _ = w.shards[None]
    for aid, adapter in enumerate(adapters, 1):
        if (layer, module) not in adapter.weights:
            continue
        a, b = adapter.weights[(layer, module)]
        _slot(linear, adapters, rows).weights[aid] = _placed(a[:, start:end], b * adapter.scale, w)


def _placed(a: torch.Tensor, b: torch.Tensor, like: torch.Tensor):
    return (a.to(like.device, like.dtype).contiguous(), b.to(like.device, like.dtype).contiguous())


def row_groups(lora_ids: np.ndarray, device: torch.device) -> list[tuple[int, Rows]]:
    """A step's groups from each row's adapter id (0: none): one per adapter present, its rows
    as a slice when contiguous (a view, no gather)."""
    groups: list[tuple[int, Rows]] = []
    for aid in np.unique(lora_ids).tolist():
        if aid == 0:
            continue
        idx = np.flatnonzero(lora_ids == aid)
        if idx[-1] - idx[0] + 1 == len(idx):
            groups.append((aid, slice(int(idx[0]), int(idx[-1]) + 1)))
        else:
            groups.append((aid, torch.from_numpy(idx).to(device)))
    return groups
