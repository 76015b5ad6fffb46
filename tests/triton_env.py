"""Import first in Triton kernel tests (tests/conftest.py imports it before any test module):
picks the device and, without CUDA, turns on Triton's interpreter before Triton is imported.
Triton decides interpreter-vs-compiled when a function is decorated, its own library's included
(triton.language's @jit reductions, decorated when Triton is imported), so the flag must be set
before anything imports Triton: peft and transformers do. It is set for the whole test process.
IMPORTED_BEFORE: Triton was already loaded, uninterpreted, when this module ran (kernel tests
skip: interpreted kernels calling its compiled library functions fail)."""
from __future__ import annotations

import os
import sys

import torch

IMPORTED_BEFORE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
    else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
