"""Exact block copies of float32 linear weights, for the decode GEMV (csrc/cpu_gemv_blocks.cpp).

A checkpoint dequantized from GGUF holds float32 weights that are, block by block along each
row, a few bits each: Q4_1 (the default model's layers) w = d * q + m, 32 weights, q in
[0, 15], d and m half-precision numbers; Q8_0 (its embedding, tied to the lm_head) w = d * q,
q in [-127, 127]. A decode step reads every weight once and is bound by memory, so it reads
such a weight from its codes and scales instead: 6 (Q4) or 9 (Q8) bytes per 8 weights instead
of 32. The kernel rebuilds each block in registers as exactly these float32 values, so it
computes the float32 GEMV's bits; a copy is kept only where rebuilding reproduces the whole
weight bit for bit (checked here, at load, whatever the checkpoint says about itself).
"""
from __future__ import annotations

import torch

BLOCK = 32
_ROWS_AT_ONCE = 4096  # rows checked per slice: bounds the check's temporaries (~20 x a slice)


def _block_scales(blocks: torch.Tensor, low: torch.Tensor) -> list[torch.Tensor]:
    """Candidate d for each block: half-precision values around (max - min) / 15. Half
    precision keeps d * q exact in float32 (11 + 4 significant bits), as the kernel needs."""
    span = blocks.amax(-1, keepdim=True) - low
    near = (span / 15).to(torch.float16)
    out = []
    for step in (0, 1, -1):  # the nearest half, then its neighbours (m's rounding can shift it)
        d = (near.view(torch.int16) + step).view(torch.float16).float()
        out.append(torch.where(span == 0, torch.zeros_like(d), d))
    return out


def _first_exact(blocks: torch.Tensor, candidates, encode, rebuild, code_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For every block [rows, blocks, 32], the first candidate scale ([rows, blocks, 1] each)
    whose codes encode(1 / scale) give back the block bit for bit as rebuild(scale, codes), in
    float32 as the kernel computes it: (scales, codes), or None where some block has none.
    Compared as bits, so -0.0 and NaN never pass for something else; a candidate that is not
    finite somewhere is not tried."""
    found = torch.zeros(blocks.shape[:-1] + (1,), dtype=torch.bool)
    s_of = torch.zeros(blocks.shape[:-1] + (1,), dtype=blocks.dtype)
    q_of = torch.zeros_like(blocks, dtype=code_dtype)
    bits = blocks.view(torch.int32)
    for s in candidates:
        if not torch.isfinite(s).all():
            continue
        q = encode(torch.where(s == 0, torch.zeros_like(s), 1 / s))
        ok = (rebuild(s, q).view(torch.int32) == bits).all(-1, keepdim=True) & ~found
        s_of = torch.where(ok, s, s_of)
        q_of = torch.where(ok, q.to(code_dtype), q_of)
        found |= ok
        if bool(found.all()):  # later candidates could change no block
            return s_of, q_of
    return None


def _q4_slice(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows, k = w.shape
    blocks = w.reshape(rows, k // BLOCK, BLOCK)
    low = blocks.amin(-1, keepdim=True)  # the block's q = 0 weight: m itself
    # float32 d * q + m, rounded once as the kernel's fused multiply-add rounds it (d * q is
    # exact: d is a half)
    got = _first_exact(blocks, _block_scales(blocks, low),
                       lambda inv: torch.round((blocks - low) * inv).clamp_(0, 15),
                       lambda d, q: torch.addcmul(low, d, q), torch.uint8)
    if got is None:
        return None
    d, q = got
    packed = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return packed.reshape(rows, k // 2), torch.cat([d, low], -1)


def _by_slices(weight: torch.Tensor, find) -> tuple[torch.Tensor, torch.Tensor] | None:
    """find(slice of rows) over the weight's rows, the pieces joined; None where any slice has
    none (or the weight is not a float32 CPU matrix with whole blocks in a row)."""
    if (weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or weight.shape[1] % BLOCK or weight.numel() == 0):
        return None
    codes, scales = [], []
    with torch.inference_mode():
        for start in range(0, weight.shape[0], _ROWS_AT_ONCE):
            got = find(weight[start:start + _ROWS_AT_ONCE].contiguous())
            if got is None:
                return None
            codes.append(got[0])
            scales.append(got[1])
    return torch.cat(codes).contiguous(), torch.cat(scales).contiguous()


def q4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [N, K / 2] uint8, dm [N, K / 32, 2] float32) that rebuild the float32 weight [N, K]
    bit for bit (byte j of a block: weight j's q in the low nibble, j + 16's in the high one;
    dm: d, m), or None when it is not such a weight."""
    return _by_slices(weight, _q4_slice)


def _q8_slice(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows, k = w.shape
    blocks = w.reshape(rows, k // BLOCK, BLOCK)
    near = blocks.abs().amax(-1, keepdim=True) / 127  # the block's largest |q| is 127
    # as computed, or a half's (GGUF's d); rebuilt as the kernel's one float32 product
    got = _first_exact(blocks, (near, near.to(torch.float16).float()),
                       lambda inv: torch.round(blocks * inv).clamp_(-127, 127),
                       lambda s, q: q * s, torch.int8)
    if got is None:
        return None
    s, q = got
    return q.reshape(rows, k), s.reshape(rows, k // BLOCK)


def q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [N, K] int8, scales [N, K / 32] float32) that rebuild the float32 weight [N, K] bit
    for bit (w = scale * q, one float32 product), or None when it is not such a weight."""
    return _by_slices(weight, _q8_slice)


def keep_block_copy(weight: torch.Tensor) -> int:
    """Attaches weight.block_copy = (kind, codes, scales) when the weight has an exact copy:
    kind "q4" (q4_blocks) or else "q8" (q8_blocks); cpu_ops.linear and the fused decode layers
    then read it. Returns the copy's bytes (0: none)."""
    for kind, find in (("q4", q4_blocks), ("q8", q8_blocks)):
        got = find(weight)
        if got is not None:
            weight.block_copy = (kind, *got)  # type: ignore[attr-defined]
            return sum(t.numel() * t.element_size() for t in got)
    return 0
