"""Sliding-window attention and attention-logit soft-capping in the CPU attention kernels: the
torch reference and the C++ kernels (through cpu_ops) against a plain float64 computation, the
C++ kernels' skipping of what lies outside a window, and their bits where an option changes
nothing."""
from __future__ import annotations

import pytest
import torch

from tpllm_kernels import cpu_ops
from tpllm_kernels import reference as ref
from tpllm_kernels.metadata import DecodeBatch, PrefillChunk
from tests.required import no_cpu_kernels, portable_build_loaded

IMPLS = {"reference": ref, "cpu": cpu_ops}
DTYPES = [torch.float32, torch.bfloat16]
# bf16: the same bf16 inputs in float64, the output rounded once (the reference rounds per op)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
BIG = 10 ** 6  # a window longer than any context here: no window
SOFTCAPS = [0.0, 5.0]  # scores below are about N(0, 9): a cap of 5 bends most of them


def _impl(name: str):
    if name == "cpu" and not cpu_ops.AVAILABLE:
        no_cpu_kernels()
    return IMPLS[name]


def _require_fast_prefill() -> None:
    """The C++ prefill kernel where a SIMD build has it (the portable build falls back to the
    reference by design)."""
    if not cpu_ops.AVAILABLE:
        no_cpu_kernels()
    if not cpu_ops._fast_prefill(64) and not portable_build_loaded():
        no_cpu_kernels("no C++ prefill attention in this SIMD build")


def _kv_map(hq: int, hkv: int, uneven: bool) -> torch.Tensor | None:
    """None (even GQA) or an explicit query -> KV head map of an uneven tensor-parallel split."""
    return torch.tensor([min(h * hkv // hq, hkv - 1) for h in range(hq)]) if uneven else None


def naive(q, kc, vc, table, qpos, ctx, scale, kv_index, window, softcap):
    """float64 attention of queries q [T, Hq, D] at positions qpos [T] over the first ctx tokens of
    the paged cache at `table`: explicit scores, cap, causal and window mask, softmax."""
    hq, hkv = q.shape[1], kc.shape[2]
    if kv_index is None:
        kv_index = torch.arange(hq) // (hq // hkv)
    k = kc[table].flatten(0, 1)[:ctx].double()[:, kv_index]  # [ctx, Hq, D]
    v = vc[table].flatten(0, 1)[:ctx].double()[:, kv_index]
    s = torch.einsum("thd,khd->htk", q.double(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    kpos, qpos = torch.arange(ctx)[None, :], torch.as_tensor(qpos)[:, None]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    p = torch.softmax(s.masked_fill(~mask[None], float("-inf")), dim=-1)
    return torch.einsum("htk,khd->thd", p, v)


def naive_decode(q, kc, vc, tables, lens, scale, kv_index, window, softcap):
    return torch.cat([naive(q[b:b + 1], kc, vc, tables[b], [n - 1], n, scale, kv_index, window,
                            softcap) for b, n in enumerate(lens.tolist())])


def _decode_inputs(seed, lens, hq, hkv, d, bs, dtype, nb=None):
    g = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // bs)
    nb = nb or len(lens) * width + 3
    kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    tables = torch.randperm(nb, generator=g)[:len(lens) * width].view(len(lens), width)
    # q a strided view (the fused qkv rows); * 3: peaked softmax, scores the cap bends
    q = (torch.randn(len(lens), hq + 2 * hkv, d, generator=g) * 3).to(dtype)[:, :hq]
    lens = torch.tensor(lens)
    return q, kc, vc, tables, lens, DecodeBatch(tables, lens, int(lens.max()), bs)


# (query heads, KV heads, uneven map, head dim, block size): in an AVX2 or AVX-512 build every
# head dim here (a multiple of 16) takes the two-pass SIMD kernel, 64, 128 and 256 unrolled, 16
# with its chunk count at run time; the portable build runs 64 and 128 on its vector block step,
# 16 and 256 on the generic one
DECODE_CASES = [(8, 2, False, 64, 16), (5, 2, True, 64, 5), (9, 3, False, 128, 16),
                (6, 2, True, 16, 5), (4, 1, False, 256, 16)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv, uneven, d, bs", DECODE_CASES)
@pytest.mark.parametrize("window", [0, 1, 5, 37, BIG])
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_decode_attention_matches_naive(impl, dtype, hq, hkv, uneven, d, bs, window, softcap):
    """One query per sequence at position context_len - 1, contexts of different lengths in one
    batch (shorter and longer than the window, a block boundary each side)."""
    ops = _impl(impl)
    lens = [1, 7, 16, 17, 90, 301]
    q, kc, vc, tables, lens, batch = _decode_inputs(d * 7 + bs + window % 97, lens, hq, hkv, d,
                                                    bs, dtype)
    kvi = _kv_map(hq, hkv, uneven)
    got = ops.decode_attention(q, kc, vc, batch, d ** -0.5, kvi, window=window, softcap=softcap)
    assert got.dtype == dtype and got.shape == q.shape
    want = naive_decode(q, kc, vc, tables, lens, d ** -0.5, kvi, window, softcap)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("splits", [0, 1, 3, 7])
@pytest.mark.parametrize("d", [64, 128, 40])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, softcap", [(1, 0.0), (300, 0.0), (700, 5.0), (BIG, 5.0)])
def test_cpu_decode_attention_splits_long_windows(splits, d, dtype, window, softcap):
    """Long contexts split into several tasks (0: the kernel's fixed-size splits, at block
    multiples from the context's start, only those reaching into the window; else the window's
    blocks in that many parts), merged; a short sequence beside the long ones."""
    _impl("cpu")
    hq, hkv = 6, 2
    q, kc, vc, tables, lens, batch = _decode_inputs(splits * 10 + d + window, [1000, 20, 777],
                                                    hq, hkv, d, 16, dtype)
    got = cpu_ops.decode_attention(q, kc, vc, batch, 0.125, None, num_splits=splits,
                                   window=window, softcap=softcap)
    want = naive_decode(q, kc, vc, tables, lens, 0.125, None, window, softcap)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [40, 300])
def test_cpu_decode_verify_rows_with_a_window_keep_their_bits(dtype, window):
    """Rows of one sequence verifying drafts (lengths one apart) attend as one task where their
    windows start in the same block, in several where a block boundary lies between: each row's
    output is the bits it gets alone, and matches the float64 attention."""
    _impl("cpu")
    hq, hkv, d, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(window)
    nb = 120
    kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(nb, generator=g)[:60]
    # windows of 40 start at 214..221 (block 13 to 13) and 235..241 (block 14 to 15); 300 at
    # 600..607 (block 37 to 37)
    lens = torch.tensor(list(range(254, 262)) + list(range(275, 282)) + list(range(900, 908)))
    tables = table.expand(len(lens), -1).contiguous()
    q = (torch.randn(len(lens), hq, d, generator=g) * 3).to(dtype)
    batch = DecodeBatch(tables, lens, int(lens.max()), bs)
    got = cpu_ops.decode_attention(q, kc, vc, batch, 0.125, window=window, softcap=5.0)
    want = naive_decode(q, kc, vc, tables, lens, 0.125, None, window, 5.0)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    for i in range(len(lens)):
        one = DecodeBatch(tables[i:i + 1], lens[i:i + 1], int(lens[i]), bs)
        alone = cpu_ops.decode_attention(q[i:i + 1], kc, vc, one, 0.125, window=window,
                                         softcap=5.0)
        assert torch.equal(got[i:i + 1], alone), i


# Head dims beyond 64 at every GQA ratio: 128 (Qwen3) and 256 (Gemma 2/3) unrolled in the SIMD
# kernel, 80 and 48 its run-time chunk count, 40 the portable block step (not a multiple of 16)
GQA_HEAD_DIMS = [128, 256, 80, 48, 40]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", GQA_HEAD_DIMS)
@pytest.mark.parametrize("ratio", range(1, 9))
def test_cpu_decode_attention_head_dims_and_gqa_ratios(dtype, d, ratio):
    """1 to 8 query heads per KV head (2 KV heads), with and without a window and the soft-cap,
    in one task per context and split across tasks: the float64 attention."""
    _impl("cpu")
    hkv = 2
    hq = hkv * ratio
    q, kc, vc, tables, lens, batch = _decode_inputs(d * 10 + ratio, [1, 16, 17, 301, 700], hq,
                                                    hkv, d, 16, dtype)
    for window, softcap in ((0, 0.0), (37, 0.0), (300, 5.0), (BIG, 5.0)):
        want = naive_decode(q, kc, vc, tables, lens, d ** -0.5, None, window, softcap)
        for splits in (0, 3):
            got = cpu_ops.decode_attention(q, kc, vc, batch, d ** -0.5, None, splits,
                                           window=window, softcap=softcap)
            torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv, d", [(5, 2, 128), (7, 3, 256), (4, 1, 256), (8, 1, 256),
                                        (16, 8, 128), (5, 2, 80)])
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_cpu_decode_attention_large_head_dims_skip_and_map(dtype, hq, hkv, d, softcap):
    """Head dims 128 and 256 (and 80) with an uneven query -> KV head map where hq is no multiple
    of hkv, Gemma's one KV head, and blocks wholly before the window poisoned with NaN: never
    read, the output finite and right; a row of context 0 gets zeros."""
    _impl("cpu")
    bs, window = 16, 50
    lens = [700, 333, 20, 0]
    q, kc, vc, tables, lens_t, batch = _decode_inputs(d + hq, lens, hq, hkv, d, bs, dtype)
    kvi = _kv_map(hq, hkv, hq % hkv != 0)
    want = naive_decode(q[:3], kc, vc, tables, lens_t[:3], d ** -0.5, kvi, window, softcap)
    for b, n in enumerate(lens):
        first_block = max(0, n - window) // bs
        kc[tables[b, :first_block]] = float("nan")
        vc[tables[b, :first_block]] = float("nan")
    for splits in (0, 1, 3):
        got = cpu_ops.decode_attention(q, kc, vc, batch, d ** -0.5, kvi, splits, window=window,
                                       softcap=softcap)
        torch.testing.assert_close(got[:3].double(), want, **TOL[dtype])
        assert torch.equal(got[3], torch.zeros_like(got[3]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv, d", [(16, 8, 128), (8, 1, 256), (6, 2, 80)])
def test_cpu_decode_verify_rows_of_large_head_dims_keep_their_bits(dtype, hq, hkv, d):
    """Verify rows (one sequence, lengths one apart) of head dims beyond 64 attend as one task in
    the SIMD kernel too, with a window and the soft-cap: each row's output is the bits it gets
    alone, and matches the float64 attention."""
    _impl("cpu")
    bs, window = 16, 40
    g = torch.Generator().manual_seed(d + hq)
    nb = 80
    kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(nb, generator=g)[:40]
    # windows of 40 start at 214..218 (block 13 to 13, the rows across a split boundary) and
    # 588..595 (block 36 to 37); none below 40 tokens
    lens = torch.tensor(list(range(254, 259)) + list(range(628, 636)) + [30, 31])
    tables = table.expand(len(lens), -1).contiguous()
    q = (torch.randn(len(lens), hq, d, generator=g) * 3).to(dtype)
    batch = DecodeBatch(tables, lens, int(lens.max()), bs)
    for w, cap in ((window, 5.0), (0, 0.0)):
        got = cpu_ops.decode_attention(q, kc, vc, batch, d ** -0.5, window=w, softcap=cap)
        want = naive_decode(q, kc, vc, tables, lens, d ** -0.5, None, w, cap)
        torch.testing.assert_close(got.double(), want, **TOL[dtype])
        for i in range(len(lens)):
            one = DecodeBatch(tables[i:i + 1], lens[i:i + 1], int(lens[i]), bs)
            alone = cpu_ops.decode_attention(q[i:i + 1], kc, vc, one, d ** -0.5, window=w,
                                             softcap=cap)
            assert torch.equal(got[i:i + 1], alone), (w, i)


# (query heads, KV heads, uneven map, head dim, block size): head_dim 64 float32 runs the C++
# kernel, other head dims the reference (cpu_ops' fallback)
PREFILL_CASES = [(9, 3, False, 64, 16), (5, 2, True, 64, 5), (4, 4, False, 64, 16),
                 (8, 2, False, 128, 5), (6, 2, True, 16, 16)]
# (chunk tokens, cached prefix tokens)
CHUNKS = [(1, 0), (37, 0), (13, 50), (64, 200), (100, 30)]


def _prefill_inputs(seed, tokens, prefix, hq, hkv, d, bs, dtype):
    g = torch.Generator().manual_seed(seed)
    ctx = prefix + tokens
    nblk = -(-ctx // bs)
    table = torch.randperm(nblk + 4, generator=g)[:nblk] + 1
    kc, vc = (torch.randn(nblk + 6, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    q = (torch.randn(tokens, hq + 2 * hkv, d, generator=g) * 3).to(dtype)[:, :hq]
    k = kc[table].flatten(0, 1)[prefix:ctx]  # the chunk's own k/v, as the model passes them
    v = vc[table].flatten(0, 1)[prefix:ctx]
    return q, k, v, kc, vc, table, PrefillChunk(0, tokens, ctx, table)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv, uneven, d, bs", PREFILL_CASES)
@pytest.mark.parametrize("tokens, prefix", CHUNKS)
@pytest.mark.parametrize("window", [0, 1, 40, BIG])
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_prefill_attention_matches_naive(impl, dtype, hq, hkv, uneven, d, bs, tokens, prefix,
                                         window, softcap):
    """A chunk's rows at positions context_len - length ... context_len - 1, over a cached
    prefix longer than the window too."""
    ops = _impl(impl)
    if impl == "cpu" and dtype == torch.float32 and d == 64:
        _require_fast_prefill()
    q, k, v, kc, vc, table, chunk = _prefill_inputs(tokens * 31 + prefix + d + bs, tokens, prefix,
                                                    hq, hkv, d, bs, dtype)
    kvi = _kv_map(hq, hkv, uneven)
    got = ops.prefill_attention(q, k, v, kc, vc, chunk, d ** -0.5, kvi, window=window,
                                softcap=softcap)
    assert got.dtype == dtype and got.shape == q.shape
    want = naive(q, kc, vc, table, torch.arange(prefix, prefix + tokens), prefix + tokens,
                 d ** -0.5, kvi, window, softcap)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_decode_attention_skips_blocks_outside_the_window(softcap, dtype):
    """Blocks wholly before a sequence's window are never read: NaN there leaves the output
    finite and right, on every decode path (the SIMD two-pass kernel at head_dim 64 and 128 and
    at 16's run-time chunk count, or the portable build's block steps; context splits). A row
    of context 0 (padding) gets zeros."""
    _impl("cpu")
    hq, hkv, bs, window = 4, 2, 16, 50
    lens = [700, 333, 20, 0]
    for d in (64, 128, 16):
        q, kc, vc, tables, lens_t, batch = _decode_inputs(d, lens, hq, hkv, d, bs, dtype)
        want = naive_decode(q[:3], kc, vc, tables, lens_t[:3], 0.125, None, window, softcap)
        for b, n in enumerate(lens):
            first_block = max(0, n - window) // bs
            kc[tables[b, :first_block]] = float("nan")
            vc[tables[b, :first_block]] = float("nan")
        for splits in (0, 1, 3):
            got = cpu_ops.decode_attention(q, kc, vc, batch, 0.125, None, splits,
                                           window=window, softcap=softcap)
            torch.testing.assert_close(got[:3].double(), want, **TOL[dtype])
            assert torch.equal(got[3], torch.zeros_like(got[3]))


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("tokens, prefix, window", [(64, 200, 40), (100, 300, 1), (9, 500, 77)])
def test_cpu_prefill_attention_skips_keys_outside_the_window(softcap, tokens, prefix, window):
    """Keys more than a key chunk (32) before the chunk's first window are never read (the kernel
    starts at the first window's chunk): NaN there leaves the output finite and right."""
    _require_fast_prefill()
    hq, hkv, d, bs = 6, 2, 64, 16
    q, k, v, kc, vc, table, chunk = _prefill_inputs(tokens + prefix, tokens, prefix, hq, hkv, d,
                                                    bs, torch.float32)
    want = naive(q, kc, vc, table, torch.arange(prefix, prefix + tokens), prefix + tokens, 0.125,
                 None, window, softcap)
    unread = max(0, prefix + 1 - window - 32) // bs  # blocks wholly before that key
    assert unread > 0
    kc[table[:unread]] = float("nan")
    vc[table[:unread]] = float("nan")
    got = cpu_ops.prefill_attention(q, k, v, kc, vc, chunk, 0.125, window=window,
                                    softcap=softcap)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_window_longer_than_the_context_is_no_window(dtype):
    """A window covering the whole context computes exactly what no window does (the same
    blocks, splits and sums), in decode and prefill."""
    _impl("cpu")
    for d in (64, 16):
        q, kc, vc, _, lens, batch = _decode_inputs(d, [1, 50, 600], 9, 3, d, 16, dtype)
        for splits in (0, 3):
            plain = cpu_ops.decode_attention(q, kc, vc, batch, 0.125, None, splits)
            for window in (600, BIG):
                got = cpu_ops.decode_attention(q, kc, vc, batch, 0.125, None, splits,
                                               window=window)
                assert torch.equal(got, plain), (d, splits, window)
    if dtype == torch.float32 and cpu_ops._fast_prefill(64):  # else the reference's SDPA
        q, k, v, kc, vc, _, chunk = _prefill_inputs(5, 70, 130, 9, 3, 64, 16, dtype)
        plain = cpu_ops.prefill_attention(q, k, v, kc, vc, chunk, 0.125)
        for window in (200, BIG):
            got = cpu_ops.prefill_attention(q, k, v, kc, vc, chunk, 0.125, window=window)
            assert torch.equal(got, plain), window
