"""Moves a step's integer arrays (numpy, int64) to the model's device.

CPU: torch.from_numpy views, no copy (the CPU path is unchanged by the GPU path).
CUDA: the arrays are packed into one pinned host buffer and sent with one asynchronous copy,
then split into device views: one transfer per step instead of one per array. Two pinned
buffers alternate, and a buffer is only rewritten after its previous copy has finished (an event),
so a fast host never overwrites bytes still in flight.
"""
from __future__ import annotations

import numpy as np
import torch


class DeviceInputs:
    def __init__(self, device: torch.device | str, capacity: int = 1 << 16,
                 pack: bool | None = None):
        """pack (default: on CUDA only) stages through the host buffers; forcing it on CPU
        tests the packing (the returned tensors then alias a staging buffer)."""
        self.device = torch.device(device)
        self._on_cuda = self.device.type == "cuda"
        self._pack = self._on_cuda if pack is None else pack
        self._bufs: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self._turn = 0
        if self._pack:
            for _ in range(2):
                self._bufs.append(self._host(capacity))
                self._events.append(None)

    def _host(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, pin_memory=self._on_cuda)

    def to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """One tensor per array (same shape, int64) on the device."""
        if not self._pack:
            return [torch.from_numpy(a) for a in arrays]
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        i = self._turn
        self._turn ^= 1
        if self._events[i] is not None:
            self._events[i].synchronize()  # its last copy is done (nearly always already)
        if total > self._bufs[i].numel():  # rare: grows once to the largest step seen
            self._bufs[i] = self._host(max(total, 2 * self._bufs[i].numel()))
        host = self._bufs[i][:total]
        flat = host.numpy()
        off = 0
        for a, n in zip(arrays, sizes):
            flat[off:off + n] = a.reshape(-1)
            off += n
        dev = host.to(self.device, non_blocking=True)
        if self._on_cuda:
            self._events[i] = torch.cuda.Event()
            self._events[i].record(torch.cuda.current_stream(self.device))
        out, off = [], 0
        for a, n in zip(arrays, sizes):
            out.append(dev[off:off + n].view(a.shape))
            off += n
        return out
