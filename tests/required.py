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
