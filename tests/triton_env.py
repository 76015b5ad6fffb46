"""Import first in Triton kernel tests: picks the device and, without CUDA, turns on Triton's
interpreter before Triton is imported (it decides interpreter-vs-compiled when kernels are
decorated, and reads the flag again lazily, so it is set for the whole test process)."""
from __future__ import annotations

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
    else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
