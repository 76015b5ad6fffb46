"""Sliding-window attention and attention-logit soft-capping (Gemma 2) in the Triton attention
kernels, against a naive float64 attention written out here: gather the paged cache, explicit
scores, cap, causal + window mask, softmax: the kernels are pinned to the definition itself,
not to tpllm_kernels.reference (which takes the same options):
- window W > 0: the query at position p sees keys p - W < j <= p (transformers'
  `kv_idx > q_idx - sliding_window`); a decode query is at context_len - 1, a prefill chunk's
  rows at context_len - length .. context_len - 1.
- softcap c > 0: s = c * tanh(q.k * scale / c), then the softmax.

The kernels must not read keys before the window at all (the key loops start at the window):
every cached token before the first one any query needs is NaN in the cache the kernels read,
so a kernel that loaded such a tile and only masked it would return NaN (0 * NaN in p @ V).

Without a GPU the kernels run in Triton's interpreter (BLOCK_N 128, BLOCK_M up to 128): contexts
past 128 and a chunk of more than 128 tokens make several key and query tiles there.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from tests.triton_env import DEVICE, interpreter_missing  # noqa: E402  (sets TRITON_INTERPRET)

pytest.importorskip("triton")

from tpllm_kernels import triton_attention as T  # noqa: E402
from tpllm_kernels.metadata import DecodeBatch, PrefillChunk  # noqa: E402

if interpreter_missing():
    pytest.skip("Triton was imported before TRITON_INTERPRET was set", allow_module_level=True)

# float32 against float64: the kernels' float32 softmax and the exp2-based tanh (a few ulp of
# the capped logit) stay well inside these. bf16: the interpreter truncates (not rounds) to bf16.
TOL = {torch.float32: dict(rtol=2e-5, atol=4e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

# (name, window, softcap): softcap alone, window alone, both, a window larger than every
# context, window 1 (each query sees only itself), window 1 with a cap
OPTIONS = [
    ("softcap", 0, 2.0),
    ("window", 24, 0.0),
    ("window+softcap", 24, 2.0),
    ("window>ctx", 1000, 0.0),
    ("window1", 1, 0.0),
    ("window1+softcap", 1, 3.0),
    ("wide-window+softcap", 150, 5.0),  # more than one interpreter key tile inside the window
]
HEAD_DIMS = [16, 64, 128, 256]
# every option at every head dim, but 256 (the interpreter's slowest) only with both options on
CASES = [pytest.param(*o, d, id=f"{o[0]}-{d}") for d in HEAD_DIMS for o in OPTIONS
         if d < 256 or o[0] in ("window+softcap", "wide-window+softcap", "window1+softcap")]


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _paged(g: torch.Generator, lens: list[int], bs: int, hkv: int, d: int, dtype: torch.dtype):
    """K/V caches with each sequence's blocks scattered at random, and the block tables."""
    need = [max(1, -(-n // bs)) for n in lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=g).tolist()
    tables = [[perm.pop() for _ in range(k)] for k in need]
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    return kc, vc, [torch.tensor(t) for t in tables]


def _kv_map(hq: int, hkv: int, kv_index: torch.Tensor | None) -> torch.Tensor:
    return torch.arange(hq) // (hq // hkv) if kv_index is None else kv_index


def naive_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor,
                    ctx: int, kv_map: torch.Tensor, scale: float, window: int,
                    softcap: float) -> torch.Tensor:
    """float64 attention of q [T, Hq, D] (the last T positions of a `ctx`-token sequence) to
    the sequence's cached keys 0 .. ctx - 1."""
    bs = kc.shape[1]
    pos = torch.arange(ctx)
    k = kc[table[pos // bs], pos % bs].double()[:, kv_map]  # [ctx, Hq, D]
    v = vc[table[pos // bs], pos % bs].double()[:, kv_map]
    s = torch.einsum("thd,jhd->htj", q.double(), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    qpos = torch.arange(ctx - q.shape[0], ctx)
    allowed = pos[None, :] <= qpos[:, None]
    if window > 0:
        allowed &= pos[None, :] > qpos[:, None] - window
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("htj,jhd->thd", s.softmax(-1), v)


def _poison_before(kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, first: int):
    """Copies of the caches with the sequence's tokens 0 .. first - 1 set to NaN."""
    kc, vc = kc.clone(), vc.clone()
    bs = kc.shape[1]
    pos = torch.arange(max(0, first))
    kc[table[pos // bs], pos % bs] = float("nan")
    vc[table[pos // bs], pos % bs] = float("nan")
    return kc, vc


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not actual.isnan().any(), "NaN in kernel output (a key before the window was read?)"
    torch.testing.assert_close(actual.double(), expected, **TOL[actual.dtype])


def _check_options_matter(expected, q, kc, vc, table, ctx, kv_map, scale, window, softcap):
    """The option under test changes the attention here (else the case proves nothing). Under
    window 1 a query's one key gets weight 1 whatever the cap."""
    if softcap > 0 and window != 1:
        plain = naive_attention(q, kc, vc, table, ctx, kv_map, scale, window, 0.0)
        assert (plain - expected).abs().max() > 1e-2, "the cap does not bite in this case"
    if 0 < window < ctx:
        plain = naive_attention(q, kc, vc, table, ctx, kv_map, scale, 0, softcap)
        assert (plain - expected).abs().max() > 1e-2, "the window excludes nothing here"


# (query heads, kv heads, kv_index, block size, context lengths): even GQA (3 query heads per
# KV head, read once per group) and the uneven map TP makes (kv_index, one head per program);
# one-token contexts, partial blocks, a context over two interpreter key tiles
DECODE_SHAPES = [
    (6, 2, None, 7, [1, 11, 40, 203]),
    (3, 2, [0, 1, 1], 5, [30, 2, 160]),
]


@pytest.mark.parametrize("name,window,softcap,d", CASES)
def test_decode_window_softcap(name, window, softcap, d):
    # the head dims take turns at each shape x {1 split, 4 splits} (the whole grid costs twice
    # the interpreter time for little more): split-K divides the window, not the context
    i = HEAD_DIMS.index(d)
    hq, hkv, kv_index, bs, lens = DECODE_SHAPES[i % 2]
    splits = 4 if i in (1, 2) else 1
    g = _gen("decode", name, d)
    kc, vc, tables = _paged(g, lens, bs, hkv, d, torch.float32)
    kv_index = None if kv_index is None else torch.tensor(kv_index)
    kv_map = _kv_map(hq, hkv, kv_index)
    scale = d ** -0.5
    # scaled queries: scores of a few units, where a cap of 2-5 changes the softmax
    q = torch.randn(len(lens), hq, d, generator=g) * 3
    width = max(t.numel() for t in tables)
    bt = torch.stack([torch.nn.functional.pad(t, (0, width - t.numel())) for t in tables])
    expected = torch.stack([naive_attention(q[i:i + 1], kc, vc, tables[i], n, kv_map, scale,
                                            window, softcap)[0] for i, n in enumerate(lens)])
    i_long = max(range(len(lens)), key=lambda i: lens[i])
    _check_options_matter(expected[i_long:i_long + 1], q[i_long:i_long + 1], kc, vc,
                          tables[i_long], lens[i_long], kv_map, scale, window, softcap)
    if window > 0:  # nothing before each sequence's window may be read
        for t, n in zip(tables, lens):
            kc, vc = _poison_before(kc, vc, t, n - window)
    batch = DecodeBatch(bt.to(DEVICE), torch.tensor(lens, device=DEVICE), max(lens), bs)
    out = T.decode_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), batch, scale,
                             None if kv_index is None else kv_index.to(DEVICE), window=window,
                             softcap=softcap, num_splits=splits)
    _close(out.cpu(), expected)


def test_decode_bf16_and_padding_rows():
    """bf16 K/V and queries, both options, split-K; a zero-length row (CUDA-graph padding)
    still returns zeros with a window."""
    g = _gen("decode-bf16")
    hq, hkv, d, bs, lens, window, softcap = 6, 2, 64, 8, [50, 9, 1], 16, 4.0
    kc, vc, tables = _paged(g, lens, bs, hkv, d, torch.bfloat16)
    q = (torch.randn(3, hq, d, generator=g) * 3).to(torch.bfloat16)
    kv_map = _kv_map(hq, hkv, None)
    expected = torch.stack([naive_attention(q[i:i + 1], kc, vc, tables[i], n, kv_map, d ** -0.5,
                                            window, softcap)[0] for i, n in enumerate(lens)])
    bt = torch.stack([torch.nn.functional.pad(t, (0, 7 - t.numel())) for t in tables])
    for splits in (1, 2):
        batch = DecodeBatch(bt.to(DEVICE), torch.tensor(lens[:2] + [0], device=DEVICE), 50, bs)
        out = T.decode_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), batch, d ** -0.5,
                                 window=window, softcap=softcap, num_splits=splits).cpu()
        _close(out[:2], expected[:2])
        assert torch.equal(out[2], torch.zeros_like(out[2]))


# (query heads, kv heads, kv_index, block size, [(chunk length, context length)]): chunks over
# a cached prefix longer than the window, a one-token chunk, a chunk with no prefix, a chunk of
# two interpreter query tiles over a context of two key tiles
PREFILL_SHAPES = [
    (6, 2, None, 5, [(12, 60), (1, 9), (20, 20)]),
    (3, 2, [1, 0, 0], 7, [(3, 40), (150, 170)]),
]


def _prefill_case(g, shape, d, dtype, window, softcap):
    hq, hkv, kv_index, bs, chunks = shape
    kc, vc, tables = _paged(g, [c for _, c in chunks], bs, hkv, d, dtype)
    kv_index = None if kv_index is None else torch.tensor(kv_index)
    kv_map = _kv_map(hq, hkv, kv_index)
    metas, start = [], 0
    for (n, ctx), table in zip(chunks, tables):
        metas.append(PrefillChunk(start, n, ctx, table.to(DEVICE)))
        start += n
    q = (torch.randn(start, hq, d, generator=g) * 3).to(dtype)
    expected = [naive_attention(q[c.start:c.start + c.length], kc, vc, t, c.context_len, kv_map,
                                d ** -0.5, window, softcap) for c, t in zip(metas, tables)]
    kc_read, vc_read = kc, vc
    if window > 0:  # nothing before the window of a chunk's first query may be read
        for c, t in zip(metas, tables):
            kc_read, vc_read = _poison_before(kc_read, vc_read, t,
                                              c.context_len - c.length - window + 1)
    return q, (kc, vc), (kc_read, vc_read), kv_index, kv_map, tables, metas, expected


@pytest.mark.parametrize("name,window,softcap,d", CASES)
def test_prefill_window_softcap(name, window, softcap, d):
    """Every chunk in one launch (the varlen form) and the first alone (prefill_attention: the
    same kernel, the chunk's rows relative to its q; the rest would double the interpreter's
    time)."""
    shape = PREFILL_SHAPES[HEAD_DIMS.index(d) % len(PREFILL_SHAPES)]
    g = _gen("prefill", name, d)
    q, clean, (kc, vc), kv_index, kv_map, tables, metas, expected = _prefill_case(
        g, shape, d, torch.float32, window, softcap)
    i0 = max(range(len(metas)), key=lambda i: metas[i].context_len)
    c0 = metas[i0]
    _check_options_matter(expected[i0], q[c0.start:c0.start + c0.length], *clean, tables[i0],
                          c0.context_len, kv_map, d ** -0.5, window, softcap)
    dev = dict(kv_index=None if kv_index is None else kv_index.to(DEVICE), window=window,
               softcap=softcap)
    qd, kcd, vcd = q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE)
    c = metas[0]
    qc = qd[c.start:c.start + c.length]
    # k/v are unused by the kernel (it reads the cache): any tensors of the shape do
    _close(T.prefill_attention(qc, qc, qc, kcd, vcd, c, d ** -0.5, **dev).cpu(), expected[0])
    out = torch.full_like(qd, float("nan"))  # every row must be written
    T.prefill_attention_varlen(qd, kcd, vcd, metas, d ** -0.5, out=out, **dev)
    _close(out.cpu(), torch.cat(expected))


def test_prefill_bf16():
    g = _gen("prefill-bf16")
    q, _, (kc, vc), _, _, _, metas, expected = _prefill_case(
        g, PREFILL_SHAPES[0], 64, torch.bfloat16, 16, 4.0)
    out = T.prefill_attention_varlen(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), metas,
                                     64 ** -0.5, window=16, softcap=4.0)
    _close(out.cpu(), torch.cat(expected))


def test_no_options_is_the_plain_kernel():
    """window=0 / softcap=0.0 are the plain kernels' results, bit for bit, and a window at least
    the context changes nothing (decode: the same tiles; prefill: the same masks)."""
    g = _gen("plain")
    kc, vc, (table,) = _paged(g, [45], 8, 2, 32, torch.float32)
    kc, vc, table = kc.to(DEVICE), vc.to(DEVICE), table.to(DEVICE)
    q = torch.randn(1, 4, 32, generator=g).to(DEVICE)
    batch = DecodeBatch(table[None], torch.tensor([45], device=DEVICE), 45, 8)
    plain = T.decode_attention(q, kc, vc, batch, 0.2, num_splits=1)
    assert torch.equal(T.decode_attention(q, kc, vc, batch, 0.2, window=0, softcap=0.0,
                                          num_splits=1), plain)
    assert torch.equal(T.decode_attention(q, kc, vc, batch, 0.2, window=45, num_splits=1), plain)
    c = PrefillChunk(0, 10, 45, table)
    qp = torch.randn(10, 4, 32, generator=g).to(DEVICE)
    plain = T.prefill_attention(qp, qp, qp, kc, vc, c, 0.2)
    assert torch.equal(T.prefill_attention(qp, qp, qp, kc, vc, c, 0.2, window=0, softcap=0.0),
                       plain)
    assert torch.equal(T.prefill_attention(qp, qp, qp, kc, vc, c, 0.2, window=45), plain)


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        T.decode_attention(None, None, None, None, 1.0, None, 8)  # type: ignore[misc]
    with pytest.raises(TypeError):
        T.prefill_attention(None, None, None, None, None, None, 1.0, None, 8)  # type: ignore
