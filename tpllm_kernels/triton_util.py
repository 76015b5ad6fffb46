"""Launch-shape helpers shared by the Triton kernels.

The interpreter (TRITON_INTERPRET=1, how the kernels run on CPU in tests) executes every program
in Python, so there we use few programs with large blocks; on a GPU we size for occupancy.
"""
from __future__ import annotations

import functools
import os

import torch
import triton


# Triton decides interpreter vs compiler when a kernel is decorated, i.e. when the kernel
# modules (which import this one first) are imported: fix our view of it at the same moment.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when the kernels run in Triton's interpreter (CPU tensors) rather than compiled."""
    return _INTERPRETED


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors to fill; a small stand-in on CPU (interpreter)."""
    if device.type != "cuda":
        return 2
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


def rows_per_program(n_rows: int, row_block: int, interp_elems: int = 1 << 16,
                     gpu_elems: int = 2048) -> int:
    """Rows one program handles for a row-wise kernel whose row block is `row_block` wide."""
    budget = interp_elems if interpreting() else gpu_elems
    return max(1, min(pow2(n_rows), budget // row_block))


def warps_for(elems: int) -> int:
    return 1 if elems <= 512 else 2 if elems <= 1024 else 4 if elems <= 4096 else 8


def dot_precision(dtype: torch.dtype) -> str:
    """float32 dots exactly (Triton's default is tf32, ~3e-4 off); others use their own type."""
    return "ieee" if dtype == torch.float32 else "tf32"
