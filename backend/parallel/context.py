"""This rank's place in its tensor-parallel group and the collectives the model calls.

The model calls ``all_reduce`` (after attention and after the MLP, and once for the
vocab-parallel embedding) and ``gather_first`` (vocab-sharded logits to rank 0); with one rank
both are free. Fused CPU decode kernels instead do a layer's all-reduce inside the kernel when
the communicator offers it (``fused_collective`` / ``finish_fused``), or every layer's in one
kernel call (``fused_stack`` / ``stack_done``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class Communicator(Protocol):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def gather_first(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None: ...
    # optional (the shared-memory communicator): reduce_slot, gather_slot, fused_collective,
    # finish_fused, fused_stack, stack_done


@dataclass
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    comm: Communicator | None = field(default=None, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        return self.comm.all_reduce(x)

    def reduce_slot(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where to compute a partial sum ([rows, cols]) that all_reduce() then takes without
        copying it (the next all-reduce's shared-memory slot), or None: compute it anywhere."""
        slot = getattr(self.comm, "reduce_slot", None) if self.world_size > 1 else None
        return None if slot is None else slot(rows, cols, dtype)

    def fused_collective(self, numel: int, dtype: torch.dtype) -> tuple | None:
        """Arguments for a C++ kernel that does the next all-reduce itself (shared memory), or
        None: then the caller all-reduces its partial with all_reduce()."""
        fused = getattr(self.comm, "fused_collective", None) if self.world_size > 1 else None
        return None if fused is None else fused(numel, dtype)

    def finish_fused(self, out: torch.Tensor, arrived: bool, seconds: float,
                     collective: tuple) -> torch.Tensor:
        return self.comm.finish_fused(out, arrived, seconds, collective)

    def fused_stack(self, numel: int, dtype: torch.dtype) -> tuple | None:
        """Arguments for a C++ kernel that runs every layer with the all-reduces inside, or None
        (no shared memory, too large): then per layer, fused_collective or all_reduce."""
        fused = getattr(self.comm, "fused_stack", None) if self.world_size > 1 else None
        return None if fused is None else fused(numel, dtype)

    def stack_done(self, out: torch.Tensor, count: int, arrived: bool,
                   seconds: float) -> torch.Tensor:
        return self.comm.stack_done(out, count, arrived, seconds)

    def gather_slot(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where to compute this rank's [rows, cols] part of the next gather_first so that it
        is posted without a copy (its shared-memory slot), or None: compute it anywhere."""
        slot = getattr(self.comm, "gather_slot", None) if self.world_size > 1 else None
        return None if slot is None else slot(rows, cols, dtype)

    def gather_first(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Concatenate every rank's [rows, sizes[rank]] along the last dim, on rank 0 only
        (only rank 0 samples, so the others never need the full vocabulary)."""
        if self.world_size == 1:
            return x
        return self.comm.gather_first(x, sizes)


SINGLE = ParallelContext()
