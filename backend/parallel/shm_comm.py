"""One-shot all-reduce and gather over shared memory, for tensor-parallel ranks on one host.

Why: a decode step does two all-reduces per layer of a few KB each. A general-purpose library
call (gloo) costs an order of magnitude more than the data's copy (`python -m client bench tp
--transports shm,gloo`); here a rank copies its tensor into its own slot, publishes a sequence
number, waits until every peer has published the same number, and sums all slots itself, in one
C++ call when the CPU kernels are built (tpllm_kernels/csrc/shm_collectives.cpp: a few torch ops
dispatched cold between layers cost several times that call), else with torch ops.
Every rank sums the slots in the same order, so all ranks get bit-identical results.

Memory layout (one segment): per-rank flags (one cache line each), then two data buffers
(double buffering: collective k uses buffer k % 2, so a fast rank can post collective k+1
while a slow one still reads k; it can never get two ahead, since k+1 waits for everyone).
x86 keeps stores in order, so a peer that sees the flag also sees the data written before it.

Messages larger than a slot go to the fallback process group (gloo on CPU).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np
import torch

_LINE = 64  # bytes per flag: one cache line, so ranks don't false-share
_SPINS_BEFORE_YIELD = 2000  # then yield the core: TP > cores must not starve the peer it waits on
_NATIVE_SPINS = 20000  # pause instructions the C++ path spins (about a millisecond) first
_LIVENESS_EVERY_S = 0.05


def _native_kernels():
    from tpllm_kernels.cpu_ext import load
    return load()


def ranks_outnumber_cores(world: int) -> bool:
    """More ranks than cores: a rank that spins (for a collective, for the next step) would hold
    the core a peer needs, so it must yield at once instead."""
    return world > (os.cpu_count() or 1)


class PeerLostError(RuntimeError):
    """A peer rank died or stopped answering in the middle of a collective."""


def segment_bytes(world: int, slot_bytes: int) -> int:
    return world * _LINE + 2 * world * slot_bytes


class ShmCommunicator:
    def __init__(self, name: str, rank: int, world: int, slot_bytes: int, dtype: torch.dtype,
                 create: bool, fallback=None, peers_alive: Callable[[], bool] | None = None,
                 timeout_s: float = 60.0):
        self.rank, self.world, self.dtype = rank, world, dtype
        size = segment_bytes(world, slot_bytes)
        self._shm = shared_memory.SharedMemory(name=name, create=create, size=size if create else 0)
        # Spawned workers share rank 0's resource tracker, which unlinks the segment if rank 0
        # dies without closing it; only rank 0 unlinks it otherwise.
        buf = self._shm.buf
        self._flags = np.ndarray((world, _LINE // 8), dtype=np.int64, buffer=buf)
        if create:
            self._flags[:] = 0
        self._flag_col = self._flags[:, 0]  # every rank's last posted sequence number
        self.slot_elems = slot_bytes // dtype.itemsize
        data = torch.frombuffer(buf, dtype=torch.uint8, offset=world * _LINE,
                                count=2 * world * slot_bytes)
        self._slots = data.view(dtype).view(2, world, self.slot_elems)
        # the C++ hot path (tpllm_kernels/csrc): post, spin and sum in one call;
        # None = torch ops only
        self._native = _native_kernels() if dtype in (torch.float32, torch.bfloat16) else None
        self._flags_t = torch.frombuffer(buf, dtype=torch.int64, count=world * _LINE // 8).view(
            world, _LINE // 8)
        self._buffers = (self._slots[0], self._slots[1])
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._seq = 0
        self._fallback = fallback
        self._peers_alive = peers_alive
        self._timeout_s = timeout_s
        oversubscribed = ranks_outnumber_cores(world)
        self._spins = 0 if oversubscribed else _SPINS_BEFORE_YIELD
        self._native_spins = 0 if oversubscribed else _NATIVE_SPINS
        self.seconds = 0.0  # time spent inside collectives (waiting included)
        self.calls = 0

    @property
    def name(self) -> str:
        return self._shm.name

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        n = x.numel()
        if n > self.slot_elems or x.dtype != self.dtype:
            out = x.contiguous().clone()
            self._fallback.allreduce([out]).wait()
        elif self._native is not None and x.is_contiguous():
            self._seq += 1
            seq, buf = self._seq, self._buffers[self._seq & 1]
            out = self._native.shm_all_reduce(x, buf, self._flags_t, self.rank, seq,
                                              self._native_spins)
            if out is None:  # a peer is late: wait the yielding, liveness-checking way
                self._wait_all(seq)
                out = self._native.shm_sum(x, buf)
        else:
            _, used = self._post(x)
            out = used.sum(dim=0).view(x.shape)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def reduce_slot(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """This rank's slot of the next all-reduce as a [rows, cols] tensor: the caller computes
        its partial sum into it and passes it to all_reduce next, which then posts it without a
        copy. None when that all-reduce would not take the native path (size, dtype).
        Computing into the slot is as safe as all_reduce's own copy into it at the same point:
        both write this rank's slot before it posts."""
        if self._native is None or rows * cols > self.slot_elems or dtype != self.dtype:
            return None
        return self._next_slot(rows, cols)

    def fused_collective(self, numel: int, dtype: torch.dtype) -> tuple | None:
        """The next all-reduce's (slots, flags, rank, seq, spins) for a C++ kernel that posts its
        partial sum and sums every rank's itself (tpllm_kernels/csrc/decode_layer.cpp: no return to
        Python in between), or None if it cannot (no native kernels, too large, other dtype).
        The caller must run that kernel next and pass its result to finish_fused."""
        if self._native is None or numel > self.slot_elems or dtype != self.dtype:
            return None
        self._seq += 1
        return self._buffers[self._seq & 1], self._flags_t, self.rank, self._seq, self._native_spins

    def finish_fused(self, out: torch.Tensor, arrived: bool, seconds: float,
                     collective: tuple) -> torch.Tensor:
        """out is the sum if every rank arrived in the kernel's spins; else this rank's posted
        partial: wait the slow way (yielding, checking the peers live), then sum."""
        return self._settle(out, arrived, seconds, collective[3], 1)

    def fused_stack(self, numel: int, dtype: torch.dtype) -> tuple | None:
        """(both buffers, flags, rank, next seq, spins) for a C++ kernel that runs several
        all-reduces in a row (its k-th: seq + k in buffer (seq + k) % 2) and reports back with
        stack_done; None if it cannot (as fused_collective)."""
        if self._native is None or numel > self.slot_elems or dtype != self.dtype:
            return None
        return self._buffers, self._flags_t, self.rank, self._seq + 1, self._native_spins

    def stack_done(self, out: torch.Tensor, count: int, arrived: bool,
                   seconds: float) -> torch.Tensor:
        """A fused_stack kernel ran `count` all-reduces. If the peers were late for the last one
        (not arrived), out is this rank's posted partial: wait the slow way, then sum."""
        self._seq += count
        return self._settle(out, arrived, seconds, self._seq, count)

    def _settle(self, out: torch.Tensor, arrived: bool, seconds: float, seq: int,
                calls: int) -> torch.Tensor:
        """Accounts `calls` fused all-reduces; the last one (`seq`) is summed here if its peers
        were late (out: this rank's posted partial)."""
        if not arrived:
            t0 = time.perf_counter()
            self._wait_all(seq)
            out = self._native.shm_sum(out, self._buffers[seq & 1])
            seconds += time.perf_counter() - t0
        self.seconds += seconds
        self.calls += calls
        return out

    def gather_slot(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """This rank's slot of the next gather_first as [rows, cols], to compute x into (then
        gather_first posts it without a copy); None on rank 0, whose part is never posted, or
        when the gather would not fit."""
        if self.rank == 0 or rows * cols > self.slot_elems or dtype != self.dtype:
            return None
        return self._next_slot(rows, cols)

    def _next_slot(self, rows: int, cols: int) -> torch.Tensor:
        """This rank's slot in the buffer the next collective (seq + 1) uses, as [rows, cols]."""
        return self._buffers[(self._seq + 1) & 1][self.rank, :rows * cols].view(rows, cols)

    def gather_first(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Concatenate each rank's x ([rows, sizes[rank]]) along the last dim, on rank 0 only.
        Rank 0 only publishes its flag: its own part goes into the result from x directly."""
        t0 = time.perf_counter()
        rows = x.shape[0]
        if rows * max(sizes) > self.slot_elems or x.dtype != self.dtype:
            raise ValueError(f"gather of {rows}x{max(sizes)} exceeds the shared-memory slot")
        out = None
        if self.rank == 0 and self._native is not None and x.is_contiguous():
            self._seq += 1
            seq, buf = self._seq, self._buffers[self._seq & 1]
            out = self._native.shm_gather_first(x, buf, self._flags_t, seq, self._native_spins,
                                                sizes)
            if out is None:  # a peer is late: wait the yielding, liveness-checking way
                self._wait_all(seq)
                out = self._native.shm_gather_first(x, buf, self._flags_t, seq, 0, sizes)
        else:
            slots, _ = self._post(x, wait=self.rank == 0, copy=self.rank != 0)
            if self.rank == 0:
                out = torch.cat([x] + [slots[r, :rows * s].view(rows, s)
                                       for r, s in enumerate(sizes) if r > 0], dim=1)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def _post(self, x: torch.Tensor, wait: bool = True,
              copy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Publish x as collective `seq` (copied into this rank's slot unless it is that slot
        already, or `copy` is false); returns (the buffer's slots, every rank's first x.numel()
        elements). The views are cached per (buffer, size): a decode step repeats a handful of
        sizes, and building views costs more than the copy."""
        self._seq += 1
        seq = self._seq
        n = x.numel()
        views = self._views.get((seq & 1, n))
        if views is None:
            slots = self._slots[seq & 1]
            views = self._views[(seq & 1, n)] = (slots, slots[:, :n], slots[self.rank, :n])
        if copy and x.data_ptr() != views[2].data_ptr():
            views[2].copy_(x.reshape(-1))
        self._flags[self.rank, 0] = seq
        if wait:
            self._wait_all(seq)
        return views[0], views[1]

    def _wait_all(self, seq: int) -> None:
        flags = self._flag_col
        spins = 0
        while (flags < seq).any():
            spins += 1
            if spins < self._spins:
                continue
            os.sched_yield()
            if spins % 512 == 0:
                self._check_peers(seq, spins)

    def _check_peers(self, seq: int, spins: int) -> None:
        now = time.monotonic()
        if not hasattr(self, "_wait_start") or self._wait_seq != seq:
            self._wait_start, self._wait_seq, self._last_check = now, seq, 0.0
        if now - self._last_check < _LIVENESS_EVERY_S:
            return
        self._last_check = now
        if self._peers_alive is not None and not self._peers_alive():
            raise PeerLostError(f"rank {self.rank}: a peer rank died during collective {seq}")
        if now - self._wait_start > self._timeout_s:
            raise PeerLostError(f"rank {self.rank}: collective {seq} timed out after "
                                f"{self._timeout_s:.0f}s")

    def close(self, unlink: bool = False) -> None:
        # drop views before unmapping
        self._slots = self._flags = self._flag_col = self._flags_t = self._buffers = None
        self._views.clear()
        try:
            self._shm.close()
        except BufferError:
            pass  # a tensor view still alive; the mapping goes with the process
        if unlink:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
