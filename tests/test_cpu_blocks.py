"""Exact block copies of float32 weights that are Q4_1 or Q8_0 blocks (tpllm_kernels/cpu_blocks.py)
and the GEMV that reads them (csrc/cpu_gemv_blocks.cpp): a copy exists only where it rebuilds
the weight bit for bit, and the GEMV computes the float32 GEMV's bits."""
from __future__ import annotations

import pytest
import torch

from tests.required import no_cpu_kernels, not_in_portable_build
from tests.tiny_models import gguf_round_trip
from tpllm_kernels.cpu_blocks import keep_block_copy, q4_blocks, q8_blocks


def _rebuild(kind: str, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight a copy stands for: d * q + m (Q4: low nibbles first) or s * q."""
    n = codes.shape[0]
    if kind == "q8":
        blocks = scales.shape[1]
        return (codes.view(n, blocks, 32).float() * scales[..., None]).reshape(n, blocks * 32)
    blocks = scales.shape[1]
    nib = codes.view(n, blocks, 16)
    q = torch.cat([nib & 15, nib >> 4], -1).float()
    return torch.addcmul(scales[..., 1:], scales[..., :1], q).reshape(n, blocks * 32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_gguf_weight_gets_a_copy_that_rebuilds_it_bit_for_bit(kind):
    g = torch.Generator().manual_seed(0)
    w = gguf_round_trip(torch.randn(70, 224, generator=g) * 0.1, kind)
    if kind == "Q4_1":
        w[3] = 0.25  # constant blocks (d = 0)
        w[5, :32] = torch.arange(32) % 16 * 0.125 - 1  # every level of d = 1/8, m = -1
        got, shapes = q4_blocks(w), ((70, 112), (70, 7, 2))
    else:
        w[3] = 0.0  # zero blocks (s = 0)
        w[5, :32] = (torch.arange(32) - 16) * 0.5  # steps of s = 1/2 ...
        w[5, 5] = 63.5  # ... with one at 127 s
        got, shapes = q8_blocks(w), ((70, 224), (70, 7))
    assert got is not None
    codes, scales = got
    assert tuple(codes.shape) == shapes[0] and tuple(scales.shape) == shapes[1]
    assert _same_bits(_rebuild(kind[:2].lower(), codes, scales), w)
    copied = w.clone()
    assert keep_block_copy(copied) == codes.numel() + scales.numel() * 4
    assert copied.block_copy[0] == kind[:2].lower()
    # bytes per weight: 6/8 (Q4) or 9/8 (Q8) of float32's 4
    assert (codes.numel() + scales.numel() * 4) / w.numel() == (0.75 if kind == "Q4_1" else 1.125)


@pytest.mark.parametrize("case", ["random", "one_ulp_off", "k_not_blocks", "bf16", "nan",
                                  "negative_zero", "inf"])
def test_a_weight_that_is_not_blocks_gets_no_copy(case):
    g = torch.Generator().manual_seed(1)
    w = gguf_round_trip(torch.randn(8, 64, generator=g), "Q4_1")
    if case == "random":
        w = torch.randn(8, 64, generator=g)
    elif case == "one_ulp_off":
        w[2, 7] = torch.nextafter(w[2, 7], torch.tensor(9.0))
    elif case == "k_not_blocks":
        w = gguf_round_trip(torch.randn(8, 96, generator=g), "Q4_1")[:, :48]
    elif case == "bf16":
        w = torch.zeros(8, 64, dtype=torch.bfloat16)
    elif case == "nan":
        w[1, 1] = float("nan")
    elif case == "negative_zero":  # a block of zeros but one -0.0: no copy rebuilds both bits
        w[4, :32] = 0.0
        w[4, 9] = -0.0
    elif case == "inf":
        w[0, 0] = float("inf")
    copied = w.clone()
    assert keep_block_copy(copied) == 0 and not hasattr(copied, "block_copy"), case
    assert q4_blocks(w) is None and q8_blocks(w) is None, case


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 17, "SMALL_M"])
def test_the_block_gemv_computes_the_float32_gemvs_bits(kind, rows):
    from tpllm_kernels import cpu_ops
    if not cpu_ops.AVAILABLE or cpu_ops.keep_block_copy is None:
        no_cpu_kernels("no block-copy GEMV without the C++ kernels")
    rows = cpu_ops.SMALL_M if rows == "SMALL_M" else rows  # the most the C++ GEMV takes
    g = torch.Generator().manual_seed(rows)
    plain = gguf_round_trip(torch.randn(70, 224, generator=g) * 0.1, kind)  # 17 tiles of 4 + 2
    copied = plain.clone()
    assert cpu_ops.keep_block_copy(copied) > 0
    x, bias = torch.randn(rows, 224, generator=g), torch.randn(70, generator=g)
    calls = []
    block_into = cpu_ops._block_linear_into
    try:
        cpu_ops._block_linear_into = lambda *a: calls.append(a[1][0]) or block_into(*a)
        assert _same_bits(cpu_ops.linear(x, copied, bias), cpu_ops.linear(x, plain, bias))
        out = torch.empty(rows, 70)
        assert _same_bits(cpu_ops.linear_into(x, copied, out), cpu_ops.linear(x, plain))
    finally:
        cpu_ops._block_linear_into = block_into
    # AVX2 reads the float32 weight from 17 rows on (block_copy_max_rows): the same bits
    assert calls == [kind[:2].lower()] * 2 * (rows <= cpu_ops._ext.block_copy_max_rows())
    # beyond the GEMV's rows the GEMM reads the float32 weight, as without the copy
    big = torch.randn(cpu_ops.SMALL_M + 1, 224, generator=g)
    assert _same_bits(cpu_ops.linear(big, copied), cpu_ops.linear(big, plain))


def test_the_greedy_screen_shares_an_exact_int8_copy():
    """A head with an exact Q8 copy screens from that copy (no second int8 copy of it), with
    the full head's tokens and logits."""
    from backend.model.greedy_head import GreedyScreen
    from tpllm_kernels import cpu_ops
    if not cpu_ops.AVAILABLE or cpu_ops.keep_block_copy is None:
        no_cpu_kernels("no block copies without the C++ kernels")
    if not cpu_ops.GREEDY_SCREEN:
        not_in_portable_build("screened greedy head")
    g = torch.Generator().manual_seed(5)
    head = gguf_round_trip(torch.randn(1000, 224, generator=g) * 0.05, "Q8_0")
    plain = head.clone()
    assert cpu_ops.keep_block_copy(head) > 0
    screen = GreedyScreen.build(head, cpu_ops, "q8")
    assert screen.copies[0] is head.block_copy[1] and screen.copies[1] is head.block_copy[2]
    alone = GreedyScreen.build(plain, cpu_ops, "q8")  # its own copy: the same values
    assert torch.equal(alone.copies[0], screen.copies[0])
    assert torch.equal(alone.copies[2], screen.copies[2])
    x = torch.randn(2, 224, generator=g)
    full = cpu_ops.linear(x, plain)
    tokens, logits, _ = screen.screen(x, head)
    assert torch.equal(tokens, full.argmax(dim=1))
    assert _same_bits(logits, full.gather(1, tokens[:, None])[:, 0])


def test_the_block_gemv_refuses_an_empty_row():
    """K = 0 is a clear error, not a division by zero in the kernel."""
    from tpllm_kernels import cpu_ops
    if not cpu_ops.AVAILABLE or cpu_ops.keep_block_copy is None:
        no_cpu_kernels("no block-copy GEMV without the C++ kernels")
    with pytest.raises(RuntimeError, match="positive multiple of 32"):
        cpu_ops._ext.small_m_linear_q4_into(torch.zeros(1, 0), torch.zeros(4, 0, dtype=torch.uint8),
                                            torch.zeros(4, 0), None, torch.empty(1, 4))
