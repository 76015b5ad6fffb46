"""Import first in Triton kernel tests (tests/conftest.py imports it before any test module):
picks the device and, without CUDA, turns on Triton's interpreter before Triton is imported.
Triton decides interpreter-vs-compiled when a function is decorated, its own library's included
(triton.language's @jit reductions, decorated when Triton is imported), so the flag must be set
before anything imports Triton: peft and transformers do. It is set for the whole test process.
interpreter_missing(): Triton kernels cannot run on this CPU process (Triton test modules skip)."""
from __future__ import annotations

import os
import sys

import torch

IMPORTED_BEFORE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
    else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


def interpreter_missing() -> bool:
    """On CPU: Triton was already loaded, uninterpreted, when this module ran (interpreted kernels
    calling its compiled library functions fail), or the kernels' module read the flag unset."""
    if DEVICE != "cpu":
        return False
    from tpllm_kernels.triton_util import interpreting
    return IMPORTED_BEFORE or not interpreting()
