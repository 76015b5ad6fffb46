"""This rank's place in its tensor-parallel group and the collectives the model calls.

The model only ever calls ``all_reduce`` (after attention and after the MLP) and
``all_gather`` (vocab-sharded logits); with one rank both are free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class Communicator(Protocol):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...


@dataclass
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    comm: Communicator | None = field(default=None, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        return self.comm.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        return self.comm.all_gather(x, dim)


SINGLE = ParallelContext()
