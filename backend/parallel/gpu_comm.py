"""Collectives for tensor-parallel ranks on the GPUs of one host (one GPU per rank).

Same interface as the CPU shared-memory communicator (shm_comm.py): all_reduce, gather_first,
`seconds`, `calls`, close().

all_reduce: a decode step does two all-reduces per layer of a few KB to a few hundred KB; a
NCCL call has a fixed cost of tens of microseconds, most of a small step. Small messages go
through a one-shot all-reduce over torch symmetric memory instead: each rank copies its tensor
into its own buffer, which every peer can read over NVLink/P2P, and one kernel per rank sums
all peers' buffers. Large messages (prefill), dtypes the kernel lacks (float16), and setups
without symmetric memory (older torch, no P2P between the GPUs) use NCCL. Every rank decides the
path from the message alone (same size and dtype on every rank), so the ranks always agree.

gather_first: one all-gather of every rank's vocabulary shard, padded to the widest shard (the
vocabulary splits unevenly); rank 0 cuts the padding off and concatenates.

Both paths are capturable in CUDA graphs (no host synchronisation, no allocation that depends
on values). `seconds` is host time inside the calls: kernels run asynchronously, so on GPU it
measures launches, not transfers.
"""
from __future__ import annotations

import datetime
import logging
import os
import time

import torch
import torch.distributed as dist

log = logging.getLogger("backend.parallel")

ONE_SHOT_MAX_BYTES = 256 * 1024  # above this NCCL's ring/tree algorithms win on bandwidth
ONE_SHOT_DTYPES = (torch.float32, torch.bfloat16)  # what the symmetric-memory kernel supports
SYMM_MEM_ENV = "TPLLM_SYMM_MEM"  # "0" forces NCCL for every message (to compare)


def use_one_shot(nbytes: int, dtype: torch.dtype, buffer_dtype: torch.dtype | None,
                 limit_bytes: int = ONE_SHOT_MAX_BYTES) -> bool:
    """Whether a message of `nbytes` goes through the one-shot path (buffer_dtype None: the
    path is unavailable on this group). The kernel loads at least 4 bytes at a time, so the
    message must be a multiple of 4 bytes (an even count of bfloat16)."""
    return (buffer_dtype is not None and dtype == buffer_dtype and dtype in ONE_SHOT_DTYPES
            and 0 < nbytes <= limit_bytes and nbytes % 4 == 0)


def pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [rows, c] widened to [rows, width] with zeros (c <= width); x itself when c == width."""
    if x.shape[-1] == width:
        return x.contiguous()
    out = x.new_zeros((x.shape[0], width))
    out[:, :x.shape[-1]] = x
    return out


def assemble_gathered(gathered: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """[world, rows, width] padded shards -> [rows, sum(sizes)], rank order."""
    return torch.cat([gathered[r, :, :s] for r, s in enumerate(sizes)], dim=1)


class GpuCommunicator:
    def __init__(self, rank: int, world: int, device: torch.device, store: dist.Store,
                 dtype: torch.dtype, timeout: datetime.timedelta,
                 one_shot_bytes: int = ONE_SHOT_MAX_BYTES, backend: str = "nccl"):
        """Forms the group through `store` (every rank must call this). backend "gloo" with CPU
        tensors exercises everything but the one-shot path without a GPU (tests)."""
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed group already exists in this process: one "
                               "GPU tensor-parallel engine per process (use another process or "
                               "tensor_parallel_size 1)")
        self.rank, self.world, self.device = rank, world, torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        kwargs = {"device_id": self.device} if self.device.type == "cuda" else {}
        dist.init_process_group(backend, store=dist.PrefixStore("tpllm-gpu", store), rank=rank,
                                world_size=world, timeout=timeout, **kwargs)
        self.group = dist.group.WORLD
        self.group_name = self.group.group_name
        self.one_shot_bytes = one_shot_bytes
        self._buf: torch.Tensor | None = None
        if self.device.type == "cuda":
            self._buf = self._open_one_shot(dtype)
        self.seconds = 0.0
        self.calls = 0

    @property
    def one_shot_dtype(self) -> torch.dtype | None:
        return None if self._buf is None else self._buf.dtype

    def _open_one_shot(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The symmetric buffer, or None (NCCL only). Checked once against NCCL, and agreed by
        every rank: if one rank cannot use it, none does."""
        buf, why = None, ""
        if os.environ.get(SYMM_MEM_ENV, "1") == "0":
            why = f"{SYMM_MEM_ENV}=0"
        elif dtype not in ONE_SHOT_DTYPES:
            why = f"no one-shot kernel for {dtype}"
        else:
            try:
                import torch.distributed._symmetric_memory as symm_mem
                buf = symm_mem.empty(self.one_shot_bytes // dtype.itemsize, dtype=dtype,
                                     device=self.device)
                symm_mem.rendezvous(buf, self.group_name)
                x = torch.full((256,), float(self.rank + 1), dtype=dtype, device=self.device)
                got = self._one_shot(x, buf)
                if not torch.all(got == self.world * (self.world + 1) / 2):
                    raise RuntimeError("one-shot all-reduce disagrees with the expected sum")
            except Exception as e:  # older torch, no P2P between these GPUs, ...
                buf, why = None, f"{type(e).__name__}: {e}"
        ok = torch.tensor([int(buf is not None)], device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if not int(ok.item()):
            log.warning("rank %d: one-shot all-reduce off, NCCL for every message (%s)",
                        self.rank, why or "a peer rank cannot use symmetric memory")
            return None
        log.info("rank %d: one-shot all-reduce over symmetric memory up to %d KiB, NCCL above",
                 self.rank, self.one_shot_bytes // 1024)
        return buf

    def _one_shot(self, x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        src = buf[:n]
        src.copy_(x.reshape(-1))
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(src, "sum", self.group_name, out.view(-1))
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks. On the NCCL path x (a fresh tensor at every call site) is
        reduced in place and returned."""
        t0 = time.perf_counter()
        if use_one_shot(x.numel() * x.element_size(), x.dtype, self.one_shot_dtype,
                        self.one_shot_bytes):
            out = self._one_shot(x, self._buf)
        else:
            out = x.contiguous()
            dist.all_reduce(out, group=self.group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def gather_first(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Concatenate each rank's x ([rows, sizes[rank]]) along the last dim, on rank 0 only."""
        t0 = time.perf_counter()
        rows, width = x.shape[0], max(sizes)
        local = pad_columns(x, width)
        gathered = x.new_empty((self.world * rows, width))
        dist.all_gather_into_tensor(gathered, local, group=self.group)
        out = None
        if self.rank == 0:
            out = assemble_gathered(gathered.view(self.world, rows, width), sizes)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def close(self, unlink: bool = False) -> None:
        """Leave the group (`unlink` only for interface parity with the shm communicator)."""
        self._buf = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # a peer already gone: nothing left to tear down cleanly
                log.warning("rank %d: destroying the process group: %s", self.rank, e)
