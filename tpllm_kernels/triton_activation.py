"""SiLU-and-multiply over a merged gate/up projection (Triton). Same signature as the reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpllm_kernels.triton_util import interpreting, pow2, rows_per_program, warps_for


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_rows, n_cols, stride_gu, stride_o,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rows64 = rows.to(tl.int64)[:, None]
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    g = tl.load(gu_ptr + rows64 * stride_gu + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + rows64 * stride_gu + n_cols + cols[None, :], mask=mask, other=0.0)
    y = g / (1.0 + tl.exp(-g)) * u.to(tl.float32)
    tl.store(out_ptr + rows64 * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2I] (gate then up) -> silu(gate) * up: [..., I]."""
    shape, i = gate_up.shape, gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * i)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    n = gu.shape[0]
    out = torch.empty((n, i), dtype=gate_up.dtype, device=gate_up.device)
    # Interpreter: whole rows per program. GPU: 1k-column tiles keep many programs in flight.
    block = pow2(i) if interpreting() else min(1024, pow2(i))
    rows = rows_per_program(n, block, gpu_elems=1024)
    if n:
        grid = (triton.cdiv(n, rows), triton.cdiv(i, block))
        _silu_mul_kernel[grid](gu, out, n, i, gu.stride(0), out.stride(0), ROWS=rows, BLOCK=block,
                               num_warps=warps_for(rows * block))
    return out.view(*shape[:-1], i)
