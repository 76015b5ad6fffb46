"""Paged attention (Triton): decode (one query per sequence) and chunked prefill over the cache.

Same signatures as tpllm_kernels.reference. K/V are gathered token by token through the block table
(block = table[t // block_size], row t % block_size), so any block size works and a tile may
span several cache blocks. Softmax is online (flash attention) in float32, base 2.

Decode is split-K ("flash decoding"): grid (batch, head programs, splits). The split count is
fixed by the batch size and the GPU, never by the context length, and every loop bound is read
from context_lens on the device: one launch shape serves every step, as CUDA graphs need.

Two keyword options, both constexpr (WINDOW, SOFTCAP) so a kernel with neither compiles to the
plain kernel, and a model's few distinct values (Gemma 2: window 4096 on alternate layers, cap
50) are a few compiled variants:
- window W > 0 (sliding window): the query at absolute position p sees keys p - W < j <= p
  (transformers' `kv_idx > q_idx - sliding_window`). The key loops start at the window's first
  key, so tiles wholly before the window are never read.
- softcap c > 0 (Gemma 2): s = c * tanh(q.k * scale / c) before the softmax.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpllm_kernels.metadata import DecodeBatch, PrefillChunk
from tpllm_kernels.triton_util import dot_precision, interpreting, pow2, sm_count

_LOG2E = 1.4426950408889634
# Finite "minus infinity" for running maxima: keeps empty rows and splits NaN-free. Globals in
# a kernel must be constexpr to compile (the interpreter would accept a plain float).
_NEG: tl.constexpr = tl.constexpr(-1.0e30)
_LOG2E_C: tl.constexpr = tl.constexpr(_LOG2E)


@triton.jit
def _mma(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in float32. UPCAST (interpreter only): Triton 3.9's interpreter
    multiplies bf16 bit patterns as integers; float32 operands give the exact same products."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _kv_tile(base_ptr, table_ptr, tok, tmask, block_size, stride_blk, stride_slot, d, dmask):
    """[len(tok), D] rows of one KV head for token positions `tok` of one sequence."""
    blk = tl.load(table_ptr + tok // block_size, mask=tmask, other=0).to(tl.int64)
    rows = blk * stride_blk + (tok % block_size).to(tl.int64) * stride_slot
    return tl.load(base_ptr + rows[:, None] + d[None, :], mask=tmask[:, None] & dmask[None, :],
                   other=0.0)


def _qk_scale(scale: float, softcap: float) -> float:
    """The factor the kernels multiply q.k by: scale in log2 units (the softmax is base 2), or
    with a soft cap c, the argument 2 log2(e) * scale / c of the exp2 inside _softcap's tanh."""
    return 2.0 * _LOG2E * scale / softcap if softcap > 0 else scale * _LOG2E


@triton.jit
def _softcap(u, SOFTCAP: tl.constexpr):
    """c * tanh(x) in log2 units, from u = 2 log2(e) x (see _qk_scale). tanh(x) = 1 - 2 / (e^2x
    + 1) with exp2, not libdevice's tanh: that one is an extern call the interpreter cannot run.
    Clamping u keeps exp2 finite (tanh is 1.0 in float32 long before u = 64); u -> -inf gives -1
    on its own. Absolute error ~1e-7 * c: a few ulp of the capped logit."""
    t = 1.0 - 2.0 / (tl.exp2(tl.minimum(u, 64.0)) + 1.0)
    return t * (SOFTCAP * _LOG2E_C)


@triton.jit
def _online_softmax_tile(q, k_base, v_base, table, tok, tmask, smask, block_size, stride_kb,
                         stride_ks, stride_vb, stride_vs, d, dmask, qk_scale, m_i, l_i, acc,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr):
    """One KV tile of flash attention (decode and prefill share it): scores of q's rows against
    the tile (soft-capped when SOFTCAP > 0), masked by `smask`, folded into the running max, sum
    and unnormalised output. Scores are in log2 units (qk_scale, see _qk_scale)."""
    k = _kv_tile(k_base, table, tok, tmask, block_size, stride_kb, stride_ks, d, dmask)
    s = _mma(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
    if SOFTCAP > 0:
        s = _softcap(s, SOFTCAP)
    s = tl.where(smask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    v = _kv_tile(v_base, table, tok, tmask, block_size, stride_vb, stride_vs, d, dmask)
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, kv_index_ptr, out_ptr, part_ptr,
                   ml_ptr, qk_scale, block_size, n_q_heads,
                   stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                   stride_vb, stride_vs, stride_vh, stride_tb, stride_ob, stride_oh,
                   GROUP: tl.constexpr, G_PAD: tl.constexpr, HAS_KV_INDEX: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLITS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                   WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    b, hp, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = tl.arange(0, G_PAD)
    if HAS_KV_INDEX:  # uneven GQA (TP): one query head per program, its KV head from the map
        heads = hp + g
        hmask = g < 1
        kvh = tl.load(kv_index_ptr + hp).to(tl.int64)
    else:  # a KV head and its GROUP query heads: K/V are read once for the whole group
        heads = hp * GROUP + g
        hmask = g < GROUP
        kvh = hp.to(tl.int64)
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    ctx = tl.load(lens_ptr + b)
    if WINDOW > 0:  # the query is at ctx - 1: keys ctx - WINDOW .. ctx - 1, split among splits
        lo = tl.maximum(ctx - WINDOW, 0)
        per_split = tl.cdiv(tl.cdiv(ctx - lo, BLOCK_N), SPLITS) * BLOCK_N
        start = lo + split * per_split
    else:
        per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), SPLITS) * BLOCK_N
        start = split * per_split
    end = tl.minimum(start + per_split, ctx)
    table = table_ptr + b64 * stride_tb
    m_i = tl.full([G_PAD], _NEG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        tmask = tok < end
        m_i, l_i, acc = _online_softmax_tile(
            q, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, table, tok, tmask, tmask[None, :],
            block_size, stride_kb, stride_ks, stride_vb, stride_vs, d, dmask, qk_scale, m_i, l_i,
            acc, PRECISION, UPCAST, SOFTCAP)
    omask = hmask[:, None] & dmask[None, :]
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty (padding) rows give 0
        tl.store(out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=omask)
    else:  # unnormalised partials [B, Hq, SPLITS, D] and (m, l) [B, Hq, SPLITS, 2], float32
        row = (b64 * n_q_heads + heads) * SPLITS + split
        tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=omask)
        tl.store(ml_ptr + row * 2, m_i, mask=hmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=hmask)


@triton.jit
def _decode_reduce_kernel(part_ptr, ml_ptr, out_ptr, n_q_heads, stride_ob, stride_oh,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr):
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D_PAD)
    row = (b * n_q_heads + h) * SPLITS + s
    m = tl.load(ml_ptr + row * 2)
    l = tl.load(ml_ptr + row * 2 + 1)
    w = tl.exp2(m - tl.max(m, 0))
    den = tl.sum(w * l, 0)
    part = tl.load(part_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=(d < HEAD_DIM)[None, :],
                   other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def decode_splits(batch_size: int, head_programs: int, device: torch.device) -> int:
    """Enough splits to give every multiprocessor ~2 programs; a power of two, at most 64."""
    want = triton.cdiv(2 * sm_count(device), max(1, batch_size * head_programs))
    return min(64, pow2(want))


def _options(window: int, softcap: float) -> tuple[int, float]:
    """The WINDOW / SOFTCAP constexprs, normalised so that equal options share one compiled
    variant (0 and 0.0, 4096 and numpy's 4096 are one Triton cache key each)."""
    window, softcap = int(window), float(softcap)
    assert window >= 0 and softcap >= 0, "window and softcap must be >= 0 (0 = off)"
    return window, softcap


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: DecodeBatch, scale: float, kv_index: torch.Tensor | None = None, *,
                     window: int = 0, softcap: float = 0.0,
                     num_splits: int | None = None) -> torch.Tensor:
    """One query token per sequence. q: [B, Hq, D]; returns [B, Hq, D]. Rows whose context
    length is 0 (CUDA-graph padding) return zeros. window > 0: the query (position
    context_len - 1) sees its last `window` keys; softcap > 0: scores are capped (module
    docstring). num_splits (a power of two) overrides the split-K heuristic (tests)."""
    window, softcap = _options(window, softcap)
    b, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and q.stride(2) == 1
    out = torch.empty_like(q)
    if b == 0:
        return out
    table = batch.block_tables.to(q.device)
    lens = batch.context_lens.to(q.device)
    has_index = kv_index is not None
    group = 1 if has_index else hq // hkv
    head_programs = hq if has_index else hkv
    splits = num_splits or decode_splits(b, head_programs, q.device)
    assert splits & (splits - 1) == 0, "num_splits must be a power of two"
    interp = interpreting()
    # float32 ("ieee" dots on CUDA cores) spills registers at 64-token tiles
    block_n = 128 if interp else 32 if q.dtype == torch.float32 else 64
    d_pad = pow2(max(d, 16))
    g_pad = max(16, pow2(group))  # tl.dot needs M >= 16
    if splits > 1:
        part = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
        ml = torch.empty((b, hq, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # unused
    kvi = kv_index.to(q.device) if has_index else lens  # dummy pointer when unused
    _decode_kernel[(b, head_programs, splits)](
        q, k_cache, v_cache, table, lens, kvi, out, part, ml, _qk_scale(scale, softcap), bs, hq,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, G_PAD=g_pad, HAS_KV_INDEX=has_index, HEAD_DIM=d, D_PAD=d_pad,
        BLOCK_N=block_n, SPLITS=splits, PRECISION=dot_precision(q.dtype), UPCAST=interp,
        WINDOW=window, SOFTCAP=softcap, num_warps=4, num_stages=2)
    if splits > 1:
        _decode_reduce_kernel[(b, hq)](part, ml, out, hq, out.stride(0), out.stride(1),
                                       HEAD_DIM=d, D_PAD=d_pad, SPLITS=splits, num_warps=1)
    return out


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, q_start_ptr, q_len_ptr, ctx_ptr,
                    kv_index_ptr, qk_scale, block_size,
                    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, stride_tb, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HAS_KV_INDEX: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr,
                    SOFTCAP: tl.constexpr):
    tile, h, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_len = tl.load(q_len_ptr + seq)
    q_start = tl.load(q_start_ptr + seq).to(tl.int64)
    ctx = tl.load(ctx_ptr + seq)
    if HAS_KV_INDEX:
        kvh = tl.load(kv_index_ptr + h).to(tl.int64)
    else:
        kvh = (h // GROUP).to(tl.int64)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < q_len
    qpos = ctx - q_len + m  # absolute position of each query token
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    rows = q_start + m.to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    # keys up to this tile's last query; a tile past the chunk's end runs no iterations
    end = tl.where(tile * BLOCK_M < q_len, tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M), 0)
    if WINDOW > 0:  # from the oldest key the tile's first query sees: skip tiles before it
        lo = tl.maximum(ctx - q_len + tile * BLOCK_M - WINDOW + 1, 0)
    else:
        lo = 0
    table = tables_ptr + seq.to(tl.int64) * stride_tb
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for t0 in range(lo, end, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        tmask = tok < end
        smask = tmask[None, :] & (tok[None, :] <= qpos[:, None])
        if WINDOW > 0:  # later rows of the tile start later: mask per row
            smask = smask & (tok[None, :] > qpos[:, None] - WINDOW)
        m_i, l_i, acc = _online_softmax_tile(
            q, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, table, tok, tmask, smask,
            block_size, stride_kb, stride_ks, stride_vb, stride_vs, d, dmask, qk_scale, m_i, l_i,
            acc, PRECISION, UPCAST, SOFTCAP)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def _varlen_meta(chunks: list[PrefillChunk], relative: bool,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(int64 [3, S] rows q_start/q_len/ctx_len, [S, W] block tables, max chunk length)."""
    width = max(int(c.block_table.numel()) for c in chunks)
    tables = torch.zeros((len(chunks), max(1, width)), dtype=torch.int64)
    for i, c in enumerate(chunks):
        tables[i, :c.block_table.numel()] = c.block_table
    info = torch.tensor([[0 if relative else c.start for c in chunks],
                         [c.length for c in chunks], [c.context_len for c in chunks]],
                        dtype=torch.int64)
    return info.to(device), tables.to(device), max(c.length for c in chunks)


def _launch_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, meta: tuple[torch.Tensor, torch.Tensor, int], scale: float,
                    kv_index: torch.Tensor | None, window: int, softcap: float) -> torch.Tensor:
    window, softcap = _options(window, softcap)
    info, tables, max_len = meta
    _, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and q.stride(2) == 1
    if interpreting():  # few, large programs
        block_m, block_n = max(16, min(pow2(max_len), 128)), 128
    else:  # float32 (exact "ieee" dots, no tensor cores) spills at 64x64 tiles
        block_m, block_n = (16, 32) if q.dtype == torch.float32 else (64, 64)
    has_index = kv_index is not None
    kvi = kv_index.to(q.device) if has_index else info
    grid = (triton.cdiv(max_len, block_m), hq, tables.shape[0])
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, tables, info[0], info[1], info[2], kvi,
        _qk_scale(scale, softcap), bs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=hq // hkv, HAS_KV_INDEX=has_index, HEAD_DIM=d, D_PAD=pow2(max(d, 16)),
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype),
        UPCAST=interpreting(), WINDOW=window, SOFTCAP=softcap, num_warps=4, num_stages=2)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
                      kv_index: torch.Tensor | None = None, *, window: int = 0,
                      softcap: float = 0.0) -> torch.Tensor:
    """A chunk of one sequence's prompt (q: [Tq, Hq, D]) attending causally to its whole cached
    context (its last `window` keys per query when window > 0; softcap: module docstring). K/V
    are read from the cache (the chunk's own were written there first); `k`/`v` are accepted
    for signature parity with the reference."""
    meta = chunk.__dict__.get("_triton_meta")  # built once per step, shared by every layer
    if meta is None or meta[0].device != q.device:
        meta = chunk.__dict__["_triton_meta"] = _varlen_meta([chunk], True, q.device)
    return _launch_prefill(q, k_cache, v_cache, torch.empty_like(q), meta, scale, kv_index,
                           window, softcap)


def prefill_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             chunks: list[PrefillChunk], scale: float,
                             kv_index: torch.Tensor | None = None,
                             out: torch.Tensor | None = None, *, window: int = 0,
                             softcap: float = 0.0) -> torch.Tensor:
    """Every prefill chunk of a step in one launch. q: the step's flat [T, Hq, D]; rows
    chunk.start .. start+length of `out` (default: a new tensor like q) are written. window,
    softcap: as prefill_attention."""
    out = torch.empty_like(q) if out is None else out
    if chunks:
        _launch_prefill(q, k_cache, v_cache, out, _varlen_meta(chunks, False, q.device), scale,
                        kv_index, window, softcap)
    return out
