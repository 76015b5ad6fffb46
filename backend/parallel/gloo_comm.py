"""Collectives through the process group's library calls (gloo): the transport between hosts,
where shared memory does not reach.

On one host it is selectable with TPLLM_TP_TRANSPORT=gloo (comm_select.py), so the multi-host
transport runs and is measured here (`python -m client bench tp --transports shm,gloo`): its
fixed cost per call, an order of magnitude above shared memory's, is what makes TP4 slower than
TP2 at concurrency 1 when every collective goes through it.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from backend.parallel.gpu_comm import assemble_gathered, pad_columns


class GlooCommunicator:
    def __init__(self, pg: dist.ProcessGroup, rank: int, world: int):
        self.pg, self.rank, self.world = pg, rank, world
        self.seconds = 0.0  # time spent inside collectives (waiting included)
        self.calls = 0

    @property
    def name(self) -> str:
        return ""  # no shared segment to attach to

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = x.contiguous().clone()
        self.pg.allreduce([out]).wait()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def gather_first(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Every rank's [rows, sizes[rank]] concatenated on the last dim, on rank 0 only. Shards
        are padded to the widest (gloo's all-gather needs one shape), then trimmed."""
        t0 = time.perf_counter()
        padded = pad_columns(x, max(sizes))
        gathered = padded.new_empty((self.world, *padded.shape))
        self.pg.allgather([list(gathered.unbind(0))], [padded]).wait()
        out = assemble_gathered(gathered, sizes) if self.rank == 0 else None
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def close(self, unlink: bool = False) -> None:
        self.pg = None
