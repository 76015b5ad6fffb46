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
