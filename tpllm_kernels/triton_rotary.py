"""Rotary position embedding applied IN PLACE to q/k heads (Triton).

Same signature as tpllm_kernels.reference.rotary, and it returns x, so callers that use the return
value (as the model does) cannot tell the two apart; unlike the reference, x itself is rotated
(it is a view into the qkv projection output, which nothing else reads unrotated).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpllm_kernels.triton_util import interpreting, pow2, warps_for


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, n_tok, n_heads, half,
                   stride_xt, stride_xh, stride_ct, stride_st,
                   TOKENS: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    h = tl.arange(0, HEADS)
    d = tl.arange(0, HALF)
    t64 = t.to(tl.int64)
    tmask = t < n_tok
    cs_mask = tmask[:, None] & (d < half)[None, :]
    # both halves of cos/sin are read, so tables whose halves differ are rotated exactly too
    c1 = tl.load(cos_ptr + t64[:, None] * stride_ct + d[None, :], mask=cs_mask, other=0.0)
    c2 = tl.load(cos_ptr + t64[:, None] * stride_ct + half + d[None, :], mask=cs_mask, other=0.0)
    s1 = tl.load(sin_ptr + t64[:, None] * stride_st + d[None, :], mask=cs_mask, other=0.0)
    s2 = tl.load(sin_ptr + t64[:, None] * stride_st + half + d[None, :], mask=cs_mask, other=0.0)
    c1, c2 = c1.to(tl.float32)[:, None, :], c2.to(tl.float32)[:, None, :]
    s1, s2 = s1.to(tl.float32)[:, None, :], s2.to(tl.float32)[:, None, :]
    off = t64[:, None, None] * stride_xt + h[None, :, None] * stride_xh + d[None, None, :]
    mask = tmask[:, None, None] & (h < n_heads)[None, :, None] & (d < half)[None, None, :]
    x1 = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + off + half, mask=mask, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    tl.store(x_ptr + off, (x1 * c1 - x2 * s1).to(dt), mask=mask)
    tl.store(x_ptr + off + half, (x2 * c2 + x1 * s2).to(dt), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x: [T, H, D] (any strides, last dim contiguous) in place; cos/sin
    [T, D]. Returns x."""
    t, h, d = x.shape
    assert x.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1, "last dim must be dense"
    half = d // 2
    heads, hp = pow2(h), pow2(half)
    per_tok = heads * hp
    budget = (1 << 16) if interpreting() else 2048
    tokens = max(1, min(pow2(t), budget // per_tok))
    if t:
        _rotary_kernel[(triton.cdiv(t, tokens),)](
            x, cos, sin, t, h, half, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            TOKENS=tokens, HEADS=heads, HALF=hp, num_warps=warps_for(tokens * per_tok))
    return x
