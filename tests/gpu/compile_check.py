"""Compile every Triton kernel for a real GPU target (sm_90, Hopper) on a machine without one.

The wrappers in tpllm_kernels/ are called with CPU tensors at serving shapes while Triton's
launch is replaced by compile-only ("warmup"), against a stand-in driver that reports an sm_90
target.
This catches what the interpreter cannot (non-constexpr globals, unsupported ops or shapes,
ptxas failures) and reports registers, spills and shared memory per kernel variant.

    python tests/gpu/compile_check.py [--arch 90]      # prints a table; exit 1 on any failure
Must run in a fresh process with TRITON_INTERPRET unset.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import tempfile
import traceback
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class _StandInDriver:
    """Just enough of a driver for Triton to compile (never to launch) for `arch`."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


@contextlib.contextmanager
def compile_only(arch: int, compiled: list):
    run = JITFunction.run

    def warm(self, *args, grid, warmup, **kwargs):
        k = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, k))
        return k

    previous = driver._active  # None until a real driver was needed; restored as found
    JITFunction.run = warm
    driver.set_active(_StandInDriver(arch))
    try:
        yield
    finally:
        JITFunction.run = run
        driver._active = previous


def resource_usage(cubin: bytes) -> str:
    """'REG:.. STACK:.. SHARED:.. LOCAL:..' from cuobjdump (shipped with Triton), or '?'."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return "?"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True,
                              text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    return " ".join(f"{k}={v}" for k, v in zip(("regs", "stack", "smem", "local"), m.groups())) \
        if m else "?"


def exercise(dtype: torch.dtype) -> None:
    """Every wrapper at SmolLM2-135M shapes (9 q heads, 3 KV heads, D 64, hidden 576)."""
    from tpllm_kernels import triton_activation as act, triton_attention as att
    from tpllm_kernels import triton_norm as norm, triton_rotary as rot
    from tpllm_kernels.metadata import DecodeBatch, PrefillChunk

    t, hid, hq, hkv, d, bs = 7, 576, 9, 3, 64, 16
    x = torch.randn(t, hid, dtype=dtype)
    w = torch.ones(hid, dtype=dtype)
    norm.rms_norm(x, w, 1e-5)
    norm.add_rms_norm(x, x.clone(), w, 1e-5)
    act.silu_mul(torch.randn(t, 2 * 1536, dtype=dtype))
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dtype)
    cos = torch.randn(t, d, dtype=dtype)
    rot.rotary(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos, cos)
    kc = torch.zeros(64, bs, hkv, d, dtype=dtype)
    q = torch.randn(4, hq, d, dtype=dtype)
    batch = DecodeBatch(torch.zeros(4, 8, dtype=torch.long), torch.tensor([5, 9, 100, 1]), 100, bs)
    for splits in (1, 8):
        att.decode_attention(q, kc, kc, batch, d ** -0.5, num_splits=splits)
    att.decode_attention(q, kc, kc, batch, d ** -0.5, torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 2]))
    chunk = PrefillChunk(0, t, 20, torch.arange(2))
    qp = torch.randn(t, hq, d, dtype=dtype)
    att.prefill_attention(qp, qp, qp, kc, kc, chunk, d ** -0.5)
    att.prefill_attention_varlen(qp, kc, kc, [chunk], d ** -0.5)
    # the families' variants: a sliding window, Gemma 2's logit cap
    for opts in ({"window": 8}, {"softcap": 50.0}, {"window": 8, "softcap": 50.0}):
        att.decode_attention(q, kc, kc, batch, d ** -0.5, **opts)
        att.prefill_attention_varlen(qp, kc, kc, [chunk], d ** -0.5, **opts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "unset TRITON_INTERPRET"
    compiled: list = []
    failures = 0
    for dtype in (torch.bfloat16, torch.float32):
        try:
            with compile_only(args.arch, compiled):
                exercise(dtype)
        except Exception as e:  # report every dtype's failure, then fail
            failures += 1
            traceback.print_exc()
            print(f"FAILED ({dtype}): {type(e).__name__}: {e}")
    print(f"sm_{args.arch}: {len(compiled)} kernel variants compiled")
    for name, k in compiled:
        md = k.metadata
        print(f"  {name:24} warps={md.num_warps} stages={md.num_stages} "
              f"{resource_usage(k.asm['cubin'])}")
    return 1 if failures or not compiled else 0


if __name__ == "__main__":
    sys.exit(main())
