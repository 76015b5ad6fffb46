"""Replay a batch-shaped step (the decode step) from fixed batch-size buckets.

Every input lives in a static buffer sized for the largest bucket. A call copies its n rows in
(rows narrower than the buffer's, e.g. a step's block tables, are padded to its width), pads
the rest of the smallest bucket >= n with each input's pad value (e.g. context length 0,
which the Triton decode kernel answers with zeros, and a scratch KV slot), runs the bucket and
returns the first n rows of its output (on CUDA a view of the graph's static output: read
or copy it before the next call).

On CUDA each bucket is captured once as a CUDA graph and replayed per step: one launch instead
of hundreds. Captures happen at construction, or with lazy=True at a bucket's first call (the
engine's warmup runs every bucket; under tensor parallelism every rank then captures at the same
step, so the collectives in the warm-up runs before each capture meet). on_capture(bucket) is
called after each capture (the engine counts captures after READY as cold-path events).
Elsewhere (CPU, or use_graphs=False) the same buffer logic calls the function directly, so it
is tested without a GPU; what only a GPU exercises is the capture itself (tests/gpu/check.sh).

The function must be capturable: no host synchronisation (.item(), .tolist(), printing), no
host-to-device copies, no shape that depends on tensor values; its tensors must already live on
the device. Kernels compile during the warmup run before capture, never after.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StaticInput:
    """One batch-major input: per-row shape, dtype, and the value padding rows get."""
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    pad: float | int = 0


class GraphRunner:
    def __init__(self, fn: Callable[..., torch.Tensor], buckets: Sequence[int],
                 inputs: Sequence[StaticInput], device: torch.device | str,
                 use_graphs: bool | None = None, warmup_runs: int = 2, lazy: bool = False,
                 on_capture: Callable[[int], None] | None = None):
        self.fn = fn
        self.buckets = sorted(set(int(b) for b in buckets))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets: need positive batch sizes, got {list(buckets)}")
        self.device = torch.device(device)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.specs = list(inputs)
        top = self.buckets[-1]
        self.buffers = [torch.full((top, *s.row_shape), s.pad, dtype=s.dtype, device=self.device)
                        for s in self.specs]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_captures = 0  # stays len(buckets) after construction: nothing captured later
        self.warmup_runs = warmup_runs
        self.on_capture = on_capture
        self._pool = None
        if self.use_graphs and not lazy:
            self._capture_all(warmup_runs)

    def _views(self, b: int) -> list[torch.Tensor]:
        return [buf[:b] for buf in self.buffers]

    def _capture_all(self, warmup_runs: int) -> None:
        for b in reversed(self.buckets):  # largest first: smaller ones reuse its pool memory
            self._capture(b, warmup_runs)

    def _capture(self, b: int, warmup_runs: int) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # buckets share one memory pool
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm up off the default stream, as capture requires
            for _ in range(warmup_runs):
                self.fn(*self._views(b))
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self.outputs[b] = self.fn(*self._views(b))
        self.graphs[b] = g
        self.num_captures += 1
        torch.cuda.synchronize(self.device)
        if self.on_capture is not None:
            self.on_capture(b)

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"batch of {n} exceeds the largest bucket ({self.buckets[-1]})")

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if len(args) != len(self.buffers):
            raise TypeError(f"expected {len(self.buffers)} inputs, got {len(args)}")
        n = args[0].shape[0]
        b = self.bucket_for(n)
        for buf, spec, x in zip(self.buffers, self.specs, args):
            if x.shape[1:] == buf.shape[1:]:
                buf[:n].copy_(x, non_blocking=True)
            else:  # narrower rows (a step's block tables): the rest of each row gets the pad
                buf[:n].fill_(spec.pad)
                buf[(slice(0, n), *(slice(0, k) for k in x.shape[1:]))].copy_(x, non_blocking=True)
            if b > n:
                buf[n:b].fill_(spec.pad)
        if self.use_graphs:
            if b not in self.graphs:  # lazy: first call of this bucket
                self._capture(b, self.warmup_runs)
            self.graphs[b].replay()
            out = self.outputs[b]
        else:
            out = self.fn(*self._views(b))
        return out[:n]
