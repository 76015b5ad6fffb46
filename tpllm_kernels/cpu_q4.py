"""Exact 4-bit copies of float32 linear weights, for the decode GEMV (csrc/cpu_gemv_q4.cpp).

A checkpoint dequantized from GGUF's Q4_1 (the default model's layers) holds float32 weights
that are, block by block along each row, w = d * q + m: 32 weights, q in [0, 15], d and m
half-precision numbers. A decode step reads every weight once and is bound by memory, so it
reads such a weight from (q, d, m) instead: 6 bytes per 8 weights instead of 32. The kernel
rebuilds each block in registers as exactly these float32 values, so it computes the float32
GEMV's bits; a copy is kept only where rebuilding reproduces the whole weight bit for bit
(checked here, at load, whatever the checkpoint says about itself).
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


def _q4_slice(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows, k = w.shape
    blocks = w.reshape(rows, k // BLOCK, BLOCK)
    low = blocks.amin(-1, keepdim=True)  # the block's q = 0 weight: m itself
    found = torch.zeros_like(low, dtype=torch.bool)
    d_of = torch.zeros_like(low)
    q_of = torch.zeros_like(blocks, dtype=torch.uint8)
    bits = blocks.view(torch.int32)
    for d in _block_scales(blocks, low):
        if not torch.isfinite(d).all():
            continue
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.round((blocks - low) * inv).clamp_(0, 15)
        # float32 d * q + m, rounded once as the kernel's fused multiply-add rounds it (d * q is
        # exact); compared as bits, so -0.0 and NaN never pass for something else
        ok = (torch.addcmul(low, d, q).view(torch.int32) == bits).all(-1, keepdim=True) & ~found
        d_of = torch.where(ok, d, d_of)
        q_of = torch.where(ok, q.to(torch.uint8), q_of)
        found |= ok
    if not bool(found.all()):
        return None
    packed = q_of[..., :BLOCK // 2] | (q_of[..., BLOCK // 2:] << 4)
    return packed.reshape(rows, k // 2), torch.cat([d_of, low], -1)


def q4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [N, K / 2] uint8, dm [N, K / 32, 2] float32) that rebuild the float32 weight [N, K]
    bit for bit (byte j of a block: weight j's q in the low nibble, j + 16's in the high one;
    dm: d, m), or None when it is not such a weight."""
    if (weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or weight.shape[1] % BLOCK or weight.numel() == 0):
        return None
    qs, dms = [], []
    with torch.inference_mode():
        for start in range(0, weight.shape[0], _ROWS_AT_ONCE):
            got = _q4_slice(weight[start:start + _ROWS_AT_ONCE].contiguous())
            if got is None:
                return None
            qs.append(got[0])
            dms.append(got[1])
    return torch.cat(qs).contiguous(), torch.cat(dms).contiguous()


def keep_q4_copy(weight: torch.Tensor) -> int:
    """Attaches weight.q4 = q4_blocks(weight) when it exists (cpu_ops.linear and the fused
    decode layers then read it); returns its bytes (0: none)."""
    got = q4_blocks(weight)
    if got is None:
        return 0
    weight.q4 = got  # type: ignore[attr-defined]
    return sum(t.numel() * t.element_size() for t in got)
