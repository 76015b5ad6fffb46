"""Exact 4-bit copies of float32 weights that are Q4_1 blocks (tpllm_kernels/cpu_q4.py) and the
GEMV that reads them (csrc/cpu_gemv_q4.cpp): a copy exists only where it rebuilds the weight bit
for bit, and the GEMV computes the float32 GEMV's bits."""
from __future__ import annotations

import pytest
import torch

from tests.required import no_cpu_kernels
from tests.tiny_models import q4_1_round_trip
from tpllm_kernels.cpu_q4 import q4_blocks


def _rebuild(q: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The float32 weight a copy stands for: d * q + m per block (low nibbles first)."""
    n, blocks = dm.shape[0], dm.shape[1]
    codes = torch.cat([q.view(n, blocks, 16) & 15, q.view(n, blocks, 16) >> 4], -1).float()
    return torch.addcmul(dm[..., 1:], dm[..., :1], codes).reshape(n, blocks * 32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_q4_1_weight_gets_a_copy_that_rebuilds_it_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    w = q4_1_round_trip(torch.randn(70, 224, generator=g) * 0.1)
    w[3] = 0.25  # constant blocks (d = 0) and a row of them
    w[5, :32] = torch.arange(32) % 16 * 0.125 - 1  # every level of d = 1/8, m = -1
    got = q4_blocks(w)
    assert got is not None
    q, dm = got
    assert q.shape == (70, 112) and q.dtype == torch.uint8
    assert dm.shape == (70, 7, 2) and dm.dtype == torch.float32
    assert _same_bits(_rebuild(q, dm), w)
    assert (q.numel() + dm.numel() * 4) / (w.numel() * 4) < 0.2  # 6 bytes per 8 weights


@pytest.mark.parametrize("case", ["random", "one_ulp_off", "k_not_blocks", "bf16", "nan",
                                  "negative_zero", "inf"])
def test_a_weight_that_is_not_q4_blocks_gets_no_copy(case):
    g = torch.Generator().manual_seed(1)
    w = q4_1_round_trip(torch.randn(8, 64, generator=g))
    if case == "random":
        w = torch.randn(8, 64, generator=g)
    elif case == "one_ulp_off":
        w[2, 7] = torch.nextafter(w[2, 7], torch.tensor(9.0))
    elif case == "k_not_blocks":
        w = q4_1_round_trip(torch.randn(8, 96, generator=g))[:, :48]
    elif case == "bf16":
        w = torch.zeros(8, 64, dtype=torch.bfloat16)
    elif case == "nan":
        w[1, 1] = float("nan")
    elif case == "negative_zero":  # a block of zeros but one -0.0: no d, m rebuild both bits
        w[4, :32] = 0.0
        w[4, 9] = -0.0
    elif case == "inf":
        w[0, 0] = float("inf")
    got = q4_blocks(w)
    assert got is None, f"{case}: a copy that cannot rebuild the weight"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17, 64])
def test_the_q4_gemv_computes_the_float32_gemvs_bits(rows):
    from tpllm_kernels import cpu_ops
    if not cpu_ops.AVAILABLE or cpu_ops.keep_q4_copy is None:
        no_cpu_kernels("no 4-bit GEMV without the C++ kernels")
    g = torch.Generator().manual_seed(rows)
    plain = q4_1_round_trip(torch.randn(70, 224, generator=g) * 0.1)  # 17 tiles of 4 + 2 rows
    copied = plain.clone()
    assert cpu_ops.keep_q4_copy(copied) == 70 * 112 + 70 * 7 * 2 * 4
    x, bias = torch.randn(rows, 224, generator=g), torch.randn(70, generator=g)
    calls = []
    q4_into = cpu_ops._q4_linear_into
    try:
        cpu_ops._q4_linear_into = lambda *a: calls.append(1) or q4_into(*a)
        assert _same_bits(cpu_ops.linear(x, copied, bias), cpu_ops.linear(x, plain, bias))
        out = torch.empty(rows, 70)
        assert _same_bits(cpu_ops.linear_into(x, copied, out), cpu_ops.linear(x, plain))
    finally:
        cpu_ops._q4_linear_into = q4_into
    assert len(calls) == 2
    # beyond the GEMV's rows the GEMM reads the float32 weight, as without the copy
    big = torch.randn(cpu_ops.SMALL_M + 1, 224, generator=g)
    assert _same_bits(cpu_ops.linear(big, copied), cpu_ops.linear(big, plain))
