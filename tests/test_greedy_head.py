"""The screened greedy head (backend/model/greedy_head.py, csrc greedy_argmax_screened*): the
token and logit of the full float32 head + argmax, bit for bit, from its int8 (q8) or bf16 copy."""
from __future__ import annotations

import pytest
import torch

from tpllm_kernels import cpu_ops
from tpllm_kernels import reference as ref
from tests.required import not_in_portable_build


def _dense(picks) -> torch.Tensor:
    """[B, vocab] float32: each row's logit at its token, -inf elsewhere (a GreedyPicks as the
    logits it stands for)."""
    out = torch.full(picks.shape, float("-inf"), dtype=torch.float32)
    out[torch.arange(len(picks.tokens)), torch.tensor(picks.tokens, dtype=torch.long)] = \
        torch.tensor(picks.values, dtype=torch.float32)
    return out


@pytest.mark.parametrize("m", [1, 2, 5, 9, cpu_ops.SMALL_M])  # up to the most rows it takes
@pytest.mark.parametrize("k, n, kind", [(576, 4099, "q8"), (576, 4099, "bf16"), (96, 257, "q8"),
                                        (100, 257, "bf16"), (48, 33, "bf16"), (32, 33, "q8")])
def test_greedy_screen_is_linear_then_argmax(m, k, n, kind):
    """The screened greedy head (backend/model/greedy_head.py) returns, bit for bit, the token
    and logit of linear + argmax: the first index among equal maxima included (tied rows win
    for row 0), across scales of x; a row that is not finite is handed back (-1). The kernel
    takes every row count here; a step of more than the q8 screen's max_rows (one pass of its
    kernel) is left to the full head: best() returns None."""
    from backend.model.greedy_head import GreedyPicks, GreedyScreen
    if not cpu_ops.GREEDY_SCREEN:
        not_in_portable_build("bf16 GEMV")
    g = torch.Generator().manual_seed(m * 7 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    w[n // 2] = w[n - 1] = w[3]  # three equal rows: a tie for the maximum
    screen = GreedyScreen.build(w, cpu_ops, kind)
    assert screen is not None and screen.kind == kind
    assert screen.max_rows == (cpu_ops.Q8_SCREEN_INPUTS if kind == "q8" else 0)
    assert cpu_ops.Q8_SCREEN_INPUTS in (4, 8)
    capped = bool(screen.max_rows) and m > screen.max_rows
    for scale in (0.01, 1.0, 30.0):
        x = torch.randn(m, k, generator=g) * scale
        x[0] = w[3] * 50 * scale  # row 0's maximum is the three-way tie
        full = cpu_ops.linear(x, w)
        tokens, values, candidates = screen.screen(x, w)
        want = full.argmax(dim=1)
        assert tokens[0] == 3
        assert torch.equal(tokens, want)
        assert torch.equal(values, full.gather(1, want[:, None])[:, 0])
        assert bool((candidates >= 1).all()) and int(candidates[0]) >= 3
        if capped:
            assert screen.best(x, w) is None
            continue
        tokens, values = screen.best(x, w)
        logits = _dense(GreedyPicks(tokens.tolist(), values.tolist(), n))
        assert torch.equal(logits.argmax(dim=1), want)
        assert torch.equal(logits.gather(1, want[:, None]), full.gather(1, want[:, None]))
        assert int(torch.isfinite(logits).sum()) == m  # one logit per row, -inf elsewhere
    x = torch.randn(m, k, generator=g)
    x[m - 1, 5] = float("nan")
    tokens, _, _ = screen.screen(x, w)
    assert tokens[m - 1] == -1 and torch.equal(tokens[:m - 1], cpu_ops.linear(x, w)[:m - 1].argmax(1))
    if capped:
        return
    tokens, _ = screen.best(x, w)
    assert tokens[m - 1] == -1  # left for the caller's full row


def test_q8_screen_bound_and_choice():
    """The q8 copy's per-row bound factor covers its quantization error (measured in float64,
    0 where the head already is int8 groups, as a GGUF Q8_0 head is); q8 is the default where
    the hidden size is a multiple of 32, bf16 elsewhere; q8 screens few rows on a head whose
    rows are exactly int8 groups even with near-ties."""
    from backend.model.greedy_head import Q8_GROUP, GreedyScreen, q8_copy
    if not cpu_ops.GREEDY_SCREEN:
        not_in_portable_build("screened greedy head")
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 128, generator=g) * 0.05
    q, scales, coef, wq_norm = q8_copy(w)
    deq = (q.double().view(300, -1, Q8_GROUP) * scales.double()[..., None]).view(300, 128)
    err = (w.double() - deq).norm(dim=1)
    assert bool((coef.double() >= err).all()) and bool((err > 0).all())
    assert int(q.abs().max()) == 127
    # a head that is int8 groups already (as GGUF Q8_0 dequantized: float16 scales, so every
    # q * scale is exact in float32): no quantization error, the bound is the sums' alone
    half = scales.half().float()
    exact = (q.double().view(300, -1, Q8_GROUP) * half.double()[..., None]).view(300, 128).float()
    q2, s2, coef2, _ = q8_copy(exact)
    assert torch.equal(q2, q) and torch.equal(s2, half)
    sums_alone = 1.05 * 2.2 * 128 * 2.0 ** -24 * exact.double().norm(dim=1)
    torch.testing.assert_close(coef2.double(), sums_alone, rtol=1e-6, atol=0)
    assert GreedyScreen.build(w, cpu_ops).kind == "q8"
    assert GreedyScreen.build(torch.randn(30, 100), cpu_ops).kind == "bf16"
    assert GreedyScreen.build(torch.randn(30, 100), cpu_ops, "q8") is None  # 100 % 32
    screen = GreedyScreen.build(exact, cpu_ops)
    x = torch.randn(4, 128, generator=g)
    x[1] = exact[7] * 40
    exact[9] = exact[7]  # a tie: both rows must be recomputed
    screen = GreedyScreen.build(exact, cpu_ops)
    tokens, values, candidates = screen.screen(x, exact)
    full = cpu_ops.linear(x, exact)
    assert torch.equal(tokens, full.argmax(dim=1)) and int(tokens[1]) == 7
    assert torch.equal(values, full.gather(1, tokens[:, None])[:, 0])
    assert int(candidates[1]) == 2 and int(candidates.max()) <= 3
    zero = torch.zeros(40, 64)  # all-zero groups: scale 0, q 0, exact
    tokens, values, _ = GreedyScreen.build(zero, cpu_ops).screen(torch.randn(2, 64), zero)
    assert tokens.tolist() == [0, 0] and values.tolist() == [0.0, 0.0]


def _quantize_like_the_kernel(x: torch.Tensor) -> torch.Tensor:
    """x dequantized as csrc/q8_head_screen.cpp quantizes it: per group of 32, scale = largest
    magnitude / 127 in float32, codes the nearest integers (ties to even), in float64."""
    g = x.view(-1, 32)
    s = (g.abs().amax(dim=1) / 127).double()
    return (torch.round(g.double() / s[:, None]).clamp(-127, 127) * s[:, None]).view(-1)


@pytest.mark.parametrize("m", [1, 3])
def test_q8_screen_bound_covers_the_quantized_input(m):
    """The int8 screen quantizes x per group of 32; its bound covers that error: two head rows
    a few units of a code apart, where x's quantization puts the wrong one ahead in the
    approximate logits by far more than the float32 sums' bound, still give the exact token
    and logit (the screen must recompute both). The head is exactly int8 groups, as a GGUF
    Q8_0 head, so the copy itself adds no error: only the input's term saves the token."""
    from backend.model.greedy_head import GreedyScreen
    if not cpu_ops.GREEDY_SCREEN:
        not_in_portable_build("screened greedy head")
    g = torch.Generator().manual_seed(3)
    k, n, scale = 64, 40, 2.0 ** -7  # power-of-two scales: every q * scale exact
    codes = torch.randint(-20, 21, (n, k), generator=g).float()
    x = torch.randn(m, k, generator=g) * 0.001
    # group 0 holds an outlier: its step is 0.05, and x[:, 5] = 0.03 rounds up to 0.05; group
    # 1's largest is x[:, 40] = 0.0301, quantized almost exactly
    x[:, 0], x[:, 5], x[:, 40] = 6.35, 0.03, 0.0301
    codes[0] = torch.sign(x[0]) * 60  # rows 0 and 1 lead every other row by far
    codes[:, 31] = codes[:, 63] = 127  # each group's largest code: its scale is exactly `scale`
    codes[1] = codes[0]
    codes[1, 5] += 60
    codes[1, 40] -= 60  # row 1 - row 0 = 60 * scale * (x5 - x40): slightly below 0
    w = codes * scale
    full = cpu_ops.linear(x, w)
    assert bool((full.argmax(dim=1) == 0).all())
    approx = torch.stack([w.double() @ _quantize_like_the_kernel(r) for r in x])
    gap = approx[:, 1] - approx[:, 0]  # the quantized x's view: row 1 ahead by ~0.0093
    sums_bound = 2 * 1.05 * 2.2 * k * 2.0 ** -24 * x.double().norm(dim=1) * w[0].norm()
    assert bool((gap > 10 * sums_bound).all())
    screen = GreedyScreen.build(w, cpu_ops, "q8")
    tokens, values, candidates = screen.screen(x, w)
    assert tokens.tolist() == [0] * m
    assert torch.equal(values, full[:, 0])
    assert bool((candidates >= 2).all())


def test_q8_screen_copies_a_head_with_code_minus_128():
    """The int8 screen negates the copy's codes by x's signs, which -128 does not survive: a
    head whose exact int8 copy holds -128 gets a copy of its own for the screen (+-127), and
    stays exact."""
    from backend.model.greedy_head import GreedyScreen
    if not cpu_ops.GREEDY_SCREEN:
        not_in_portable_build("screened greedy head")
    g = torch.Generator().manual_seed(9)
    codes = torch.randint(-127, 128, (300, 64), generator=g).to(torch.int8)
    codes[4, :32] = -128  # row 4's first group: all -128
    scales = torch.full((300, 2), 2.0 ** -9)
    w = (codes.float().view(300, 2, 32) * scales[..., None]).view(300, 64)
    w.block_copy = ("q8", codes, scales)
    screen = GreedyScreen.build(w, cpu_ops, "q8")
    assert screen.copies[0] is not codes and int(screen.copies[0].min()) >= -127
    x = torch.randn(5, 64, generator=g)
    x[0, :32] = -1.0  # row 4 wins: its -128s against negative inputs
    full = cpu_ops.linear(x, w)
    tokens, values, _ = screen.screen(x, w)
    assert int(tokens[0]) == 4
    assert torch.equal(tokens, full.argmax(dim=1))
    assert torch.equal(values, full.gather(1, tokens[:, None])[:, 0])


@pytest.mark.parametrize("m", [1, 2])
def test_bf16_head_screen_is_bf16_linear_then_argmax(m):
    """A bf16 head's screen (int8 copy) returns what the bf16 linear + argmax give: its logits
    are float32 sums rounded to bf16, so near-maxima collapse into ties, and the first index of
    the largest rounded value wins."""
    from backend.model.greedy_head import GreedyScreen
    if not cpu_ops.GREEDY_SCREEN:
        not_in_portable_build("screened greedy head")
    g = torch.Generator().manual_seed(11 + m)
    w = (torch.randn(4099, 128, generator=g) * 0.05).bfloat16()
    screen = GreedyScreen.build(w, cpu_ops)
    assert screen is not None and screen.kind == "q8"
    assert GreedyScreen.build(w, cpu_ops, "bf16") is None  # a bf16 copy of bf16 saves nothing
    ties = 0
    for scale in (0.01, 1.0, 30.0):
        for trial in range(4):
            x = (torch.randn(m, 128, generator=g) * scale).bfloat16()
            x[0] = (w[100].float() * 40 * scale).bfloat16()
            w2 = w.clone()
            w2[300] = w2[100]  # an exact tie; rounding adds near-ties
            w2[200] = (w2[100].float() * (1 - 2.0 ** -9)).bfloat16()
            s2 = GreedyScreen.build(w2, cpu_ops)
            full = cpu_ops.linear(x, w2).float()
            tokens, values, candidates = s2.screen(x, w2)
            want = full.argmax(dim=1)
            assert torch.equal(tokens, want), (scale, trial)
            assert torch.equal(values, full.gather(1, want[:, None])[:, 0])
            ties += int((full[0] == full[0].max()).sum()) - 1
            assert int(candidates[0]) >= 2
    assert ties > 0  # the rounding's ties were exercised
    three = torch.randn(3, 128, generator=g).bfloat16()  # more rows than the bf16 GEMV takes
    assert screen.screen(three, w) is None


@pytest.mark.parametrize("kind", ["q8", "bf16"])
def test_greedy_screen_refuses_what_it_cannot_bound(kind):
    from backend.model.greedy_head import GreedyScreen
    w = torch.randn(40, 64)
    if kind == "bf16":  # a bf16 head: its bf16 copy would save nothing
        assert GreedyScreen.build(w.bfloat16(), cpu_ops, kind) is None
    bad = w.clone()
    bad[7, 3] = float("inf")
    assert GreedyScreen.build(bad, cpu_ops, kind) is None
    assert GreedyScreen.build(w, ref, kind) is None  # the torch reference has no screen


def test_screened_head_takes_the_full_row_where_it_cannot_bound():
    """ParallelLMHead.argmax_logits: a row that is not finite gets the full head's argmax (a
    NaN counts as the maximum, as in torch) and logit while the others get their maximum
    alone, as GreedyPicks the sampler takes; more rows than the screen takes get the logits;
    TP's pick across ranks keeps the highest logit of the lowest rank (the first index, as
    argmax)."""
    from backend.engine.sampling.sampler import Sampler
    from backend.engine.sampling.sampling_params import SamplingParams
    from backend.engine.sequence import Sequence
    from backend.model.greedy_head import GreedyPicks, pick_across_ranks
    from backend.model.layers import ParallelLMHead
    from backend.parallel.context import SINGLE
    head = ParallelLMHead(300, 64, torch.float32, SINGLE, ops=cpu_ops)
    head.weight.data.copy_(torch.randn(300, 64, generator=torch.Generator().manual_seed(1)))
    if not head.enable_greedy_screening():
        not_in_portable_build("greedy screening (bf16 GEMV)")
    x = torch.randn(3, 64)
    x[1, 0] = float("nan")
    x[2] = 0.0
    x[2, 7] = float("inf")  # row 2's logits +-inf: the first +inf wins
    got, full = head.argmax_logits(x), head(x)
    assert isinstance(got, GreedyPicks) and got.shape == (3, 300)
    want = full.argmax(1)
    assert bool(full[1].isnan().all()) and int(full[2].isposinf().sum()) > 1
    assert got.tokens == want.tolist()
    torch.testing.assert_close(torch.tensor(got.values), full.gather(1, want[:, None])[:, 0],
                               rtol=0, atol=0, equal_nan=True)
    sampled = Sampler(eos_token_ids=set())(
        got, [Sequence(f"r{i}", [1, 2], 1, SamplingParams(temperature=0), i) for i in range(3)])
    assert sampled.token_ids == want.tolist() and sampled.logprobs == [None] * 3
    more = torch.randn(head.screen.max_rows + 1, 64) if head.screen.max_rows else None
    if more is not None:  # beyond one pass of the screen: the full head's logits
        assert torch.equal(head.argmax_logits(more), head(more))
    # rows: a tie between ranks 1 and 2 (rank 1 wins), rank 0 alone best, rank 2 alone best
    pairs = torch.tensor([[3., 1.0, 120., 5.0, 250., 5.0],
                          [7., 9.0, 101., 2.0, 201., 8.0],
                          [0., -1.0, 100., -2.0, 299., 0.5]])
    tokens, values = pick_across_ranks(pairs, 3)
    assert tokens.tolist() == [120, 7, 299] and values.tolist() == [5.0, 9.0, 0.5]
