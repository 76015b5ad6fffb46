"""`--cap-isa avx2`: run a benchmark as an AVX2-only host would, on a CPU with AVX-512.

Every library that picks its vector code by the CPU is capped at the same level before torch
loads: ATen's kernels (ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA), MKL
(MKL_ENABLE_INSTRUCTIONS) and our C++ kernels (TPLLM_CPU_ISA). Child processes (TP ranks, a
server, perf_analyzer) inherit the environment. What stays is this CPU's memory system, caches
and clock: a capped run measures the AVX2 code paths, not an AVX2 host's bandwidth, and every
report says which caps were in effect (`in_effect()`).
"""
from __future__ import annotations

import os
import sys

# level -> the variables that cap each library at it
CAPS: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "TPLLM_CPU_ISA": "avx2"},
}
_NAMES = tuple(dict.fromkeys(name for caps in CAPS.values() for name in caps))


def apply(level: str | None) -> None:
    """Sets the caps of `level` (None: leaves the environment alone). Must run before torch is
    imported: ATen and the GEMM libraries read their variables once, when they load."""
    if not level:
        return
    if "torch" in sys.modules:
        raise RuntimeError("--cap-isa must be applied before torch is imported")
    os.environ.update(CAPS[level])


def in_effect() -> dict[str, str]:
    """The ISA caps of this process: the variables that are set, and the level ATen's kernels
    actually dispatch to (torch's own report, which honours ATEN_CPU_CAPABILITY)."""
    import torch
    out = {name: os.environ[name] for name in _NAMES if os.environ.get(name)}
    out["aten"] = torch.backends.cpu.get_cpu_capability()
    return out


def describe(caps: dict[str, str]) -> str:
    """One phrase for a report header: 'ATen AVX512', or 'ATen AVX2, caps ATEN_...=avx2 ...'."""
    set_vars = " ".join(f"{k}={v}" for k, v in caps.items() if k != "aten")
    return f"ATen {caps.get('aten', '?')}" + (f", caps {set_vars}" if set_vars else "")
