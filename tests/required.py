"""Skips that must not hide a missing fast path in CI: `make test` sets
TPLLM_REQUIRE_CPU_KERNELS=1, under which a test that needs the C++ CPU kernels fails where they
are missing instead of skipping (a failed build would otherwise leave CI green without them)."""
from __future__ import annotations

import os

import pytest

REQUIRE_CPU_KERNELS = os.environ.get("TPLLM_REQUIRE_CPU_KERNELS") == "1"


def no_cpu_kernels(reason: str = "C++ CPU kernels not built here",
                   allow_module_level: bool = False) -> None:
    """Skip the calling test (or module) for lack of the C++ kernels; fail under the variable."""
    if REQUIRE_CPU_KERNELS:
        pytest.fail(f"{reason}, and TPLLM_REQUIRE_CPU_KERNELS=1", pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)


def not_in_portable_build(feature: str) -> None:
    """Skip the calling test for lack of a kernel that only the SIMD variants have (the bf16
    GEMV and what runs on it: the screened greedy heads). Where the loaded variant is the
    portable "generic" build (a CPU without AVX2 + FMA, a non-x86 one, or TPLLM_CPU_ISA=generic)
    the lack is by design and `make test` skips; any other variant without it is a build that
    lost it, and fails like no_cpu_kernels."""
    if portable_build_loaded():
        pytest.skip(f"the portable (generic) kernel build has no {feature}")
    no_cpu_kernels(f"no {feature} in the C++ kernels here")


def portable_build_loaded() -> bool:
    """Whether the C++ kernels loaded here are the portable "generic" build (for a test that
    goes on past the SIMD-only part instead of skipping)."""
    from tpllm_kernels import cpu_ext, cpu_ops
    return cpu_ops.AVAILABLE and cpu_ext.isa_level() == "generic"
