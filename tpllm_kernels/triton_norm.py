"""RMSNorm and fused residual-add + RMSNorm (Triton). Same signatures as tpllm_kernels.reference.

Statistics are taken in float32. The fused kernel rounds the new residual to the input dtype
before normalising it, as the reference does (its add happens in the input dtype).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpllm_kernels.triton_util import pow2, rows_per_program, warps_for


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, n_rows, n_cols,
                     stride_x, stride_r, stride_o, stride_ro, eps,
                     HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    rows64 = rows.to(tl.int64)[:, None]
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows64 * stride_r + cols[None, :], mask=mask, other=0.0)
        s = (x + r.to(tl.float32)).to(r_out_ptr.dtype.element_ty)
        tl.store(r_out_ptr + rows64 * stride_ro + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(out_ptr + rows64 * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape, h = x.shape, x.shape[-1]
    x2 = _rows(x)
    n = x2.shape[0]
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    r2 = _rows(residual) if residual is not None else x2
    r_out = torch.empty_like(out) if residual is not None else out
    block = pow2(h)
    rows = rows_per_program(n, block)
    if n:
        _rms_norm_kernel[(triton.cdiv(n, rows),)](
            x2, r2, weight, out, r_out, n, h, x2.stride(0), r2.stride(0), out.stride(0),
            r_out.stride(0), eps, HAS_RESIDUAL=residual is not None, ROWS=rows, BLOCK=block,
            num_warps=warps_for(rows * block))
    return out.view(shape), (r_out.view(shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual + x; returns (rms_norm(new residual), new residual). Out of place like the
    reference: the caller's residual tensor is not modified."""
    out, new_residual = _launch(x, residual, weight, eps)
    return out, new_residual
