"""TPLLM_REQUIRE_CPU_KERNELS=1 (`make test`, CI) turns a failed C++ kernel build into an error;
without it the engine falls back to the torch path (a user's `make serve`)."""
from __future__ import annotations

import pytest
from torch.utils import cpp_extension

from tpllm_kernels import cpu_ext


@pytest.fixture
def failing_build(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise OSError("no C++ compiler here")
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.delenv("TPLLM_CPU_KERNELS", raising=False)
    return cpu_ext.load.__wrapped__  # past the cache: a fresh attempt


def test_failed_build_falls_back_without_the_variable(failing_build, monkeypatch):
    monkeypatch.delenv("TPLLM_REQUIRE_CPU_KERNELS", raising=False)
    assert failing_build() is None


def test_failed_build_raises_under_the_variable(failing_build, monkeypatch):
    monkeypatch.setenv("TPLLM_REQUIRE_CPU_KERNELS", "1")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler here.*TPLLM_REQUIRE_CPU_KERNELS"):
        failing_build()


@pytest.mark.parametrize("require", [True, False])
@pytest.mark.parametrize("loaded", ["generic", "avx2", "none (torch reference)"])
def test_a_kernel_missing_from_a_simd_build_is_not_skipped(loaded, require, monkeypatch):
    """tests/required.not_in_portable_build: only the portable build may lack a SIMD kernel.
    Under the variable a test of one skips there and fails on a SIMD variant or without the
    kernels (a build that lost it); without the variable it skips everywhere."""
    from tests import required
    from tpllm_kernels import cpu_ops
    monkeypatch.setattr(required, "REQUIRE_CPU_KERNELS", require)
    monkeypatch.setattr(cpu_ext, "isa_level", lambda: loaded)
    monkeypatch.setattr(cpu_ops, "AVAILABLE", loaded != "none (torch reference)")
    want = pytest.skip.Exception if loaded == "generic" or not require else pytest.fail.Exception
    try:  # caught here, either way: a wrong skip must fail this test, not skip it
        required.not_in_portable_build("bf16 GEMV")
    except (pytest.skip.Exception, pytest.fail.Exception) as e:
        got, message = type(e), str(e)
    else:
        got, message = None, ""
    assert got is want and "bf16 GEMV" in message, (got, message)
