"""Serving LoRA adapters in the model's projections, batched: each row of a step with an adapter
gets scale * (x @ A^T) @ B^T (a shrink to rank r, then an expand) added to the base layer's
output. Nothing is merged into the base weights, so rows of different adapters (and rows of
none, which are left untouched) share one step.

Each linear that some adapter targets gets a LoraSlot holding this rank's matrices, sharded like
the base weight: a column-parallel layer (q/k/v, gate/up) keeps A whole and the rows of B its
output rows are made of; a row-parallel one (o, down) keeps A's columns of its input slice and B
whole, and its delta joins the partial sum before the all-reduce. The scale is folded into B.

Two forms of the same matrices:
- stacked, every adapter at once (LoraSlot.stacked; csrc/lora_delta.cpp): a step of a few float32
  rows (decode, on CPU) adds all its rows' deltas in one kernel call per projection, from the
  modular path (ops.lora_delta_) or inside the fused decode layers (llama.py binds the stacked
  weights), the same kernel, so both give the same bits. A merged layer's adapter keeps only the
  B of the parts it targets, each against its own r shrunk values.
- per adapter (LoraSlot.weights), for the rest (prefill chunks, GEMMs; other kernels): a step's
  rows grouped by adapter, each group two matrix products per layer. A merged layer (qkv,
  gate_up) stacks its targets' A matrices ([n * r, in]) and places each B in its own output rows
  and rank columns of one [out, n * r] matrix (zeros elsewhere: adding them changes no value).
  The products run on the layer's own kernels (ops.linear).
"""
from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from backend.model import host_memory
from backend.model.lora_adapter import LoraAdapter
from backend.model.layers import ColumnParallelLinear, RowParallelLinear

# our merged parameter's shard id -> PEFT's module name
_SID_MODULE = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "gate": "gate_proj", "up": "up_proj"}
Rows = slice | torch.Tensor  # a group's rows: a contiguous range, else their indices


class LoraRows:
    """The current step's adapter rows, shared by every LoraSlot of a model: the row groups
    (adapter id, rows) and each row's adapter id (int64 [T] on the host, 0: none). Empty and
    None for a step without adapter rows (the slots then add nothing)."""

    def __init__(self) -> None:
        self.groups: Sequence[tuple[int, Rows]] = ()
        self.ids: torch.Tensor | None = None

    def set(self, step: StepLora | None) -> None:
        self.groups, self.ids = (step.groups, step.ids) if step else ((), None)


class StepLora:
    """A step's adapter rows as the model takes them (row_groups): groups for the per-adapter
    products, ids for the stacked kernels. False when no row has an adapter."""

    def __init__(self, groups: list[tuple[int, Rows]], ids: torch.Tensor):
        self.groups, self.ids = groups, ids

    def __bool__(self) -> bool:
        return bool(self.groups)


class LoraSlot:
    """One linear's adapters. weights[id] = (A [R, in_local], B [out_local, R]) or None;
    stacked = (A [n, Rmax, in_local], B^T [n, rmax, out_local], layout [n, 2 + 3 S] int64) over
    all n adapters (lora_delta.cpp describes the layout), once attach_adapters is done."""

    def __init__(self, rows: LoraRows, num_adapters: int, ops: ModuleType,
                 segments: list[tuple[int, int]]):
        self.rows, self.ops = rows, ops
        self.segments = segments  # the merged parts' output rows [begin, end), in order
        self.weights: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * (num_adapters + 1)
        self.stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # adapter id -> (r, [(segment, A [r, in_local], scaled B [segment rows, r])]), until stacked
        self._parts: dict[int, tuple[int, list[tuple[int, torch.Tensor, torch.Tensor]]]] = {}

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's output for x, or its partial sum) plus each row's adapter delta,
        in place."""
        delta = getattr(self.ops, "lora_delta_", None)
        if (delta is not None and self.rows.ids is not None
                and delta(x, y, *self.stacked, self.rows.ids)):
            return y
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

    def stacked_shapes(self, like: torch.Tensor) -> list[tuple[int, ...]]:
        """The shapes of stacked's A and B^T, from the parts."""
        n, (out, d_in), parts = len(self.weights) - 1, like.shape, self._parts
        r_max = max(r for r, _ in parts.values())
        big_r = max(r * len(p) for r, p in parts.values())
        return [(n, big_r, d_in), (n, r_max, out)]

    def _stack(self, like: torch.Tensor, place=None) -> None:
        """Both forms from the parts, on like's device and dtype; place(t) puts the stacked
        ones where they are kept (default: where like is)."""
        out, parts = like.shape[0], self._parts
        a_shape, bt_shape = self.stacked_shapes(like)
        n = a_shape[0]
        a = torch.zeros(a_shape)
        bt = torch.zeros(bt_shape)
        info = torch.zeros(n, 2 + 3 * len(self.segments), dtype=torch.int64)
        info[:, 2:] = torch.tensor([v for b, e in self.segments for v in (b, e, -1)])
        for aid, (r, p) in parts.items():
            info[aid - 1, :2] = torch.tensor([r, r * len(p)])
            for j, (seg, a_part, b_part) in enumerate(p):
                begin, end = self.segments[seg]
                a[aid - 1, j * r:(j + 1) * r] = a_part
                bt[aid - 1, :r, begin:end] = b_part.t()
                info[aid - 1, 4 + 3 * seg] = j * r
        a, bt = (_placed(a, like), _placed(bt, like)) if place is None else (place(a), place(bt))
        self.stacked = (a, bt, info)
        for aid, (r, p) in parts.items():
            b = torch.zeros(out, r * len(p))
            for j, (seg, _, b_part) in enumerate(p):
                begin, end = self.segments[seg]
                b[begin:end, j * r:(j + 1) * r] = b_part
            self.weights[aid] = (a[aid - 1, :r * len(p)], _placed(b, like))
        self._parts = {}


def attach_adapters(model, adapters: Sequence[LoraAdapter]) -> LoraRows | None:
    """Give every targeted linear of `model` (LlamaForCausalLM) a LoraSlot with this rank's
    shards of `adapters` (ids 1..len(adapters), in order); returns the rows holder the model
    sets per step (None: no adapters)."""
    if not adapters:
        return None
    rows = LoraRows()
    slotted = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.qkv_proj, mlp.gate_up_proj):
            _attach_column(linear, i, adapters, rows)
        _attach_row(attn.o_proj, i, "o_proj", adapters, rows)
        _attach_row(mlp.down_proj, i, "down_proj", adapters, rows)
        slotted += [m for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                    if m.lora is not None]
    place = _arena_place(slotted)
    for linear in slotted:
        linear.lora._stack(linear.weight, place)
    model.rebind_decode()  # the fused layers bind the adapters too
    return rows


def _arena_place(slotted: list):
    """On CPU, the stacked adapters of every linear in one huge-page arena, in the order a
    decode step reads them (host_memory, as the weights): read on 4 KiB pages, each adapter's
    short blocks started another page walk and stream every few KB. Else None."""
    if not slotted or slotted[0].weight.device.type != "cpu":
        return None
    dtype = slotted[0].weight.dtype
    shapes = [s for m in slotted for s in m.lora.stacked_shapes(m.weight)]
    arena = host_memory.HostArena(host_memory.arena_bytes((s, dtype) for s in shapes))

    def place(t: torch.Tensor) -> torch.Tensor:
        return arena.take(tuple(t.shape), dtype).copy_(t)
    return place


def _slot(linear, adapters: Sequence[LoraAdapter], rows: LoraRows,
          segments: list[tuple[int, int]]) -> LoraSlot:
    if linear.lora is None:
        linear.lora = LoraSlot(rows, len(adapters), linear.ops, segments)
    return linear.lora


def _attach_column(linear: ColumnParallelLinear, layer: int, adapters: Sequence[LoraAdapter],
                   rows: LoraRows) -> None:
    w = linear.weight
    shards = list(w.shards.items())
    segments = [(offset, offset + end - start) for _, (_, start, end, offset) in shards]
    for aid, adapter in enumerate(adapters, 1):
        parts = []
        for seg, (sid, (_, start, end, _)) in enumerate(shards):
            if (layer, _SID_MODULE[sid]) in adapter.weights:
                a, b = adapter.weights[(layer, _SID_MODULE[sid])]
                parts.append((seg, a, b[start:end] * adapter.scale))
        if parts:
            _slot(linear, adapters, rows, segments)._parts[aid] = (adapter.rank, parts)


def _attach_row(linear: RowParallelLinear, layer: int, module: str,
                adapters: Sequence[LoraAdapter], rows: LoraRows) -> None:
    w = linear.weight
    _, start, end, _ = w.shards[None]
    for aid, adapter in enumerate(adapters, 1):
        if (layer, module) not in adapter.weights:
            continue
        a, b = adapter.weights[(layer, module)]
        slot = _slot(linear, adapters, rows, [(0, w.shape[0])])
        slot._parts[aid] = (adapter.rank, [(0, a[:, start:end], b * adapter.scale)])


def _placed(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(like.device, like.dtype).contiguous()


def row_groups(lora_ids: np.ndarray, device: torch.device) -> StepLora:
    """A step's adapter rows from each row's adapter id (0: none): a group per adapter present,
    its rows as a slice when contiguous (a view, no gather), and the ids themselves (int64, on
    the host: the CPU kernels read them)."""
    groups: list[tuple[int, Rows]] = []
    for aid in np.unique(lora_ids).tolist():
        if aid == 0:
            continue
        idx = np.flatnonzero(lora_ids == aid)
        if idx[-1] - idx[0] + 1 == len(idx):
            groups.append((aid, slice(int(idx[0]), int(idx[-1]) + 1)))
        else:
            groups.append((aid, torch.from_numpy(idx).to(device)))
    return StepLora(groups, torch.from_numpy(np.ascontiguousarray(lora_ids, dtype=np.int64)))
