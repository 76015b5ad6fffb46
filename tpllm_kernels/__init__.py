"""Kernel dispatch: the one place that decides the device path.

`select_ops(device)` returns the namespace the model calls (rms_norm, add_rms_norm, silu_mul,
rotary, write_kv, decode_attention, prefill_attention; same signatures in both):
  - tpllm_kernels.cpu_ops for CPU: fused C++ kernels (tpllm_kernels/csrc) for decode attention,
    add+RMSNorm and rotary+KV-cache write, the torch reference for the rest; the torch reference alone when
    the C++ kernels cannot be built here;
  - tpllm_kernels.triton_ops (OpenAI Triton) for CUDA.
The model asks once, at construction, and keeps the namespace: no per-call dispatch.

Override with the environment variable TPLLM_KERNELS (read at each select_ops call):
  auto (default)  Triton on CUDA, the C++/torch CPU path elsewhere
  torch           the torch reference everywhere (e.g. to bisect a kernel bug)
  triton          Triton everywhere; on CPU tensors this needs TRITON_INTERPRET=1 set before
                  Triton is first imported (the interpreter: slow, for tests only)

One semantic difference callers may rely on: triton_ops.rotary rotates x in place (and returns
it); reference.rotary returns a new tensor. Using the return value works with both.
`ops` (the torch reference) remains for code that predates select_ops.
"""
from __future__ import annotations

import os
from types import ModuleType

import torch

from tpllm_kernels import reference
from tpllm_kernels import reference as ops

KERNELS_ENV = "TPLLM_KERNELS"
_CHOICES = ("auto", "torch", "triton")

__all__ = ["ops", "select_ops", "KERNELS_ENV"]


def select_ops(device: torch.device | str = "cpu", force_triton: bool = False) -> ModuleType:
    """The kernel namespace for a model whose tensors live on `device`."""
    choice = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r}: must be one of {', '.join(_CHOICES)}")
    device = torch.device(device)
    if force_triton or choice == "triton" or (choice == "auto" and device.type == "cuda"):
        return _triton_ops(device)
    if choice == "auto" and device.type == "cpu":
        from tpllm_kernels import cpu_ops
        if cpu_ops.AVAILABLE:
            return cpu_ops
    return reference


def _triton_ops(device: torch.device) -> ModuleType:
    try:
        from tpllm_kernels import triton_ops
    except ImportError as e:
        raise RuntimeError(f"Triton kernels requested for {device} but Triton is not importable "
                           f"({e}); install triton or set {KERNELS_ENV}=torch") from None
    from tpllm_kernels.triton_util import interpreting
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(f"Triton kernels on {device} need TRITON_INTERPRET=1 set before Triton "
                           f"is imported (the interpreter; tests only); or set {KERNELS_ENV}=torch")
    return triton_ops
