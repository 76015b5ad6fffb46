"""The CPU path: C++ kernels where they pay (small-batch float32 and bf16 linears, decode and
prefill attention, add+RMSNorm, rotary+KV write, silu*mul; the fused decode stack, from
cpu_fused_decode.py), MKL's or oneDNN's GEMM (GEMM_LIBRARY) for prefill chunks and full decode
batches, and the torch reference for everything else and for any input the kernels don't cover
(storage other than float32 / bfloat16, non-contiguous tensors).
Same names and signatures as tpllm_kernels/reference.py, so dispatch is a namespace swap.

The C++ module is the ISA variant tpllm_kernels.cpu_ext picked for this CPU (avx512_bf16, avx512,
avx2; TPLLM_CPU_ISA forces one): the same kernels on each, so nothing here depends on it. The
measurements behind the choices below are in docs/decisions.md."""
from __future__ import annotations

import os
from functools import lru_cache

import torch
import torch.nn.functional as F

from tpllm_kernels import cpu_blocks as _blocks
from tpllm_kernels import cpu_threading as _threads
from tpllm_kernels import reference as _ref
from tpllm_kernels.cpu_ext import load
# the fused decode stack's calls, re-exported: the model calls them through this namespace
from tpllm_kernels.cpu_fused_decode import (FUSED_DECODE, FUSED_FAMILY_PARTS,  # noqa: F401
                                            decode_attention_half, decode_layer,
                                            decode_mlp_half, decode_stack, decode_stack_tp)
from tpllm_kernels.metadata import DecodeBatch, PrefillChunk, uniform_kv_index

_ext = load()

# Up to this many rows a float32 linear streams its weight once in C++ (small_m_gemm.h); more:
# GEMM_LIBRARY's GEMM, from the packed copy the engine keeps for its full decode batch (which
# serves prefill chunks too). The cut-over is where oneDNN from its packed copy overtakes the
# single weight stream; with MKL (slower on these shapes) the C++ GEMV stays ahead up to 64 rows.
# A row's bits depend on its batch only above the cut-over, which speculative decoding's token
# identity relies on. Set by the decode steps of `python -m client bench offline` (see
# docs/decisions.md, "The C++ GEMV takes up to 48 rows"). Defined below GEMM_LIBRARY.
BF16_SMALL_M = 2  # the same for bf16 (cpu_gemv_bf16.cpp); more: oneDNN
rotary = _ref.rotary
write_kv = _ref.write_kv


_STORAGE = (torch.float32, torch.bfloat16)  # what the C++ kernels read and write (math in fp32)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: DecodeBatch, scale: float,
                     kv_index: torch.Tensor | None = None, num_splits: int = 0, *,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    # The C++ kernel reads the paged cache in place (no gather copy), each block once, and splits
    # long contexts of short batches across threads; every head_dim that is a multiple of 16
    # runs the two-pass SIMD kernel (csrc/attn_simd.h, AVX2 or AVX-512, float32 or bf16 caches;
    # 64, 128 and 256 unrolled at compile time). Gathering the blocks and
    # calling SDPA copied every sequence's whole context each layer: about 3x the kernel's time.
    # A sliding window's kernel reads only the blocks the window reaches.
    if q.dtype not in _STORAGE:
        return _ref.decode_attention(q, k_cache, v_cache, batch, scale, kv_index,
                                     window=window, softcap=softcap)
    if kv_index is None:
        kv_index = uniform_kv_index(q.shape[1], k_cache.shape[2])
    return _ext.paged_decode_attention(q, k_cache, v_cache, batch.block_tables,
                                       batch.context_lens, scale, kv_index, num_splits,
                                       window, softcap)


@lru_cache(maxsize=8)
def _fast_prefill(head_dim: int) -> bool:
    return _ext is not None and _ext.prefill_attention_supported(head_dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
                      kv_index: torch.Tensor | None = None, *, window: int = 0,
                      softcap: float = 0.0) -> torch.Tensor:
    # float32, head_dim 64, AVX2/AVX-512: register-tiled C++ over the paged cache, a cached prefix
    # included (csrc/prefill_attention.cpp says why it beats SDPA). Else torch's SDPA (with a
    # window or softcap: the reference's masked or explicit form).
    if (q.dtype == torch.float32 and k_cache.dtype == torch.float32 and _fast_prefill(q.shape[-1])
            and q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()):
        if kv_index is None:
            kv_index = uniform_kv_index(q.shape[1], k_cache.shape[2])
        return _ext.paged_prefill_attention(q, k_cache, v_cache, chunk.block_table,
                                            chunk.context_len, scale, kv_index, window, softcap)
    return _ref.prefill_attention(q, k, v, k_cache, v_cache, chunk, scale, kv_index,
                                  window=window, softcap=softcap)


def rotary_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int,
                    num_kv: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In place in qkv (rotated q and k are views into it)."""
    if qkv.dtype not in _STORAGE or not qkv.is_contiguous():
        return _ref.rotary_write_kv(qkv, cos, sin, num_q, num_kv, k_cache, v_cache, slot_mapping)
    _ext.rotary_write_kv_(qkv, cos, sin, num_q, num_kv, k_cache, v_cache, slot_mapping)
    t, d = qkv.shape[0], cos.shape[-1]
    x = qkv.view(t, num_q + 2 * num_kv, d)
    return x[:, :num_q], x[:, num_q:num_q + num_kv], x[:, num_q + num_kv:]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # Decode steps: the C++ kernel reads each weight once, closer to the memory's bandwidth than
    # a library GEMM, which packs the weight per call; beyond SMALL_M rows (top of the file)
    # GEMM_LIBRARY's GEMM is faster, from the packed copy where the engine keeps one.
    if _small_m_f32(x, weight):
        if (copy := _block_copy(x, weight)) is not None:  # exact (cpu_blocks.py)
            return _block_linear_into(x, copy, bias, x.new_empty(x.shape[0], weight.shape[0]))
        return _ext.small_m_linear(x, weight, bias)
    # bf16 decode of 1-2 rows: each weight row read once, AVX512-BF16 dot products or (AVX2,
    # AVX-512) FMAs on rows widened as loaded (csrc/cpu_gemv_bf16.cpp). It beats oneDNN at one
    # and two rows; from three oneDNN is as fast or faster (docs/decisions.md, bf16 GEMV).
    if _BF16_GEMV and _small_m_bf16(x, weight):
        return _ext.small_m_linear_bf16(x, weight, bias)
    if (packed := _packed_copy(x, weight)) is not None:
        if packed[0] == "mkl":
            return torch.ops.mkl._mkl_linear(x, packed[2], weight, bias, packed[1])
        return _onednn_linear(x, packed[2], bias)
    if _onednn_f32(x, weight):
        return _onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def greedy_screen_supported(weight: torch.Tensor) -> bool:
    """Whether greedy_argmax_screened(_q8) can take this lm_head weight: float32, or bf16 (the
    int8 copy only: greedy_head.py)."""
    return (GREEDY_SCREEN and weight.dim() == 2 and weight.is_contiguous()
            and weight.dtype in (torch.float32, torch.bfloat16))


def greedy_argmax_screened(x: torch.Tensor, weight: torch.Tensor, low: torch.Tensor,
                           coef: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """Each row's argmax of x @ weight^T and that logit, exactly as linear + argmax give them,
    mostly from `low` (weight's bf16 copy; csrc/cpu_gemv_bf16.cpp), each approximate logit n
    within |x| * coef[n] of the exact one: (tokens [B], logits [B], candidates [B]; tokens -1
    for a row that is not finite). None where it does not apply."""
    if not (_BF16_GEMV and _small_m_f32(x, weight)):
        return None
    return tuple(_ext.greedy_argmax_screened(x, weight, low, coef))


def greedy_argmax_screened_q8(x: torch.Tensor, weight: torch.Tensor, q: torch.Tensor,
                              scales: torch.Tensor, coef: torch.Tensor, wq_norm: torch.Tensor
                              ) -> tuple[torch.Tensor, ...] | None:
    """greedy_argmax_screened from an int8 copy of the head in groups of 32 along the row
    (q in [-127, 127], their float32 scales, the rows' norms wq_norm: backend/model/
    greedy_head.py's q8_copy), x quantized alike (csrc/q8_head_screen.cpp), a logit within
    max(|x|, |x'|) * coef[n] + 1.05 |x - x'| * wq_norm[n]. A bf16 head (x bf16, the rows
    small_m_linear_bf16 takes) gets linear's bf16 logits: the first of the largest rounded
    values. None where it does not apply."""
    if not (_BF16_GEMV and (_small_m_f32(x, weight) or _small_m_bf16(x, weight))):
        return None
    return tuple(_ext.greedy_argmax_screened_q8(x, weight, q, scales, coef, wq_norm))


def _plain_f32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [M, K] and weight float32 and contiguous: what the C++ GEMV and oneDNN's GEMM take."""
    return (x.dim() == 2 and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.is_contiguous() and weight.is_contiguous())


def _small_m_f32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the C++ float32 GEMV takes x @ weight^T (linear and linear_into)."""
    return _plain_f32(x, weight) and x.shape[0] <= SMALL_M


def _small_m_bf16(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [M, K] and weight bf16 and contiguous, M within what the bf16 GEMV takes."""
    return (x.dim() == 2 and x.shape[0] <= BF16_SMALL_M and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and x.is_contiguous() and weight.is_contiguous())


def _onednn_f32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a float32 GEMM beyond the C++ GEMV's rows runs on oneDNN (GEMM_LIBRARY)."""
    return GEMM_LIBRARY == "onednn" and _plain_f32(x, weight)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    # weight: the plain [N, K] tensor (reordered per call, as MKL's GEMM packs per call) or
    # its reordered copy (pack_linear_weight)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packed_copy(x: torch.Tensor, weight: torch.Tensor) -> tuple | None:
    """weight's packed copy (library, rows, packed) if it serves x: MKL's only at exactly the
    rows it was packed for, oneDNN's at any row count beyond the C++ GEMV's."""
    packed = getattr(weight, "cpu_packed", None)
    if packed is None or x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    serves = x.shape[0] == packed[1] if packed[0] == "mkl" else x.shape[0] > SMALL_M
    return packed if serves else None


def linear_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """linear(x, weight) written into `out` (contiguous [rows, N]) and returned: a row-parallel
    layer's partial sum straight into its shared-memory all-reduce slot. For a prefill's GEMM
    this saves a copy into the slot per all-reduce (docs/decisions.md, Tensor parallelism), and
    with the C++ GEMV a decode step's lm_head shard straight into its logits
    gather slot. Other shapes (bf16 GEMV, packed copy, oneDNN's GEMM: it has no output
    argument) compute as linear() does, then copy."""
    if out.is_contiguous() and x.dtype == weight.dtype:
        if _small_m_f32(x, weight):
            if (copy := _block_copy(x, weight)) is not None:
                return _block_linear_into(x, copy, None, out)
            _ext.small_m_linear_into(x, weight, out)
            return out
        if (x.dim() == 2 and x.shape[0] > SMALL_M and _packed_copy(x, weight) is None
                and not _onednn_f32(x, weight)):
            return torch.mm(x, weight.t(), out=out)
    return out.copy_(linear(x, weight))


def _block_copy(x: torch.Tensor, weight: torch.Tensor) -> tuple | None:
    """weight's exact block copy if the GEMV reads it for x's rows (block_copy_max_rows)."""
    copy = getattr(weight, "block_copy", None)
    return copy if copy is not None and x.shape[0] <= _BLOCK_COPY_ROWS else None


def _block_linear_into(x: torch.Tensor, copy: tuple[str, torch.Tensor, torch.Tensor],
                       bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    kind, codes, scales = copy
    into = _ext.small_m_linear_q4_into if kind == "q4" else _ext.small_m_linear_q8_into
    into(x, codes, scales, bias, out)
    return out


def _mkl_packing() -> bool:
    try:
        return torch.backends.mkl.is_available() and bool(torch.ops.mkl._mkl_reorder_linear_weight)
    except (AttributeError, RuntimeError):
        return False


def _onednn_available() -> bool:
    try:
        return (torch.backends.mkldnn.is_available()
                and bool(torch.ops.mkldnn._linear_pointwise)
                and bool(torch.ops.mkldnn._reorder_linear_weight))
    except (AttributeError, RuntimeError):
        return False


GEMM_ENV = "TPLLM_CPU_GEMM"


def _gemm_library() -> str:
    """Which library runs the float32 GEMMs beyond the C++ GEMV's rows (prefill chunks, large
    decode batches): TPLLM_CPU_GEMM (mkl | onednn), else by the CPU: MKL on an Intel CPU with
    AVX-512 (its default before; not measured against oneDNN there), oneDNN everywhere else.
    MKL picks its code path by the CPU's vendor as well as its flags: on AMD it ran at about
    AVX2 speed even with AVX-512. oneDNN was faster on AMD with AVX2 and with AVX-512, in
    prefill and in large decode batches (docs/decisions.md, "oneDNN, not MKL"). An Intel CPU
    has not been measured with oneDNN: compare `TPLLM_CPU_GEMM=onednn python -m client bench
    offline` against the default there."""
    forced = os.environ.get(GEMM_ENV, "").strip().lower()
    if forced:
        if forced not in ("mkl", "onednn"):
            raise ValueError(f"{GEMM_ENV}={forced!r}: must be mkl or onednn")
        if forced == "onednn" and not _onednn_available():
            raise ValueError(f"{GEMM_ENV}=onednn: this torch has no oneDNN linear")
        return forced
    return "onednn" if _onednn_available() and not _mkl_by_default() else "mkl"


def _mkl_by_default() -> bool:
    from tpllm_kernels.cpu_ext import cpu_flags, cpu_vendor
    return cpu_vendor() == "GenuineIntel" and "avx512f" in cpu_flags()


GEMM_LIBRARY = _gemm_library()
SMALL_M = 48 if GEMM_LIBRARY == "onednn" else 64  # the C++ GEMV's most rows (top of the file)


def _attention_touch_pass_by_default() -> bool:
    """Whether head_dim-64 decode attention touches each K/V block in address order before its
    head-by-head passes (csrc/attn_simd.h): yes but on Intel CPUs. It sped the attention up on
    a Zen 4 and slowed it down on an Intel Xeon (`bench step-parts`; docs/decisions.md)."""
    from tpllm_kernels.cpu_ext import cpu_vendor
    return cpu_vendor() != "GenuineIntel"


if _ext is not None:
    _ext.set_attention_touch_pass(_attention_touch_pass_by_default())


def pack_linear_weight(weight: torch.Tensor, rows: int) -> int:
    """Keeps beside a float32 weight a packed copy for decode batches of `rows` rows (the
    engine's full batch), in GEMM_LIBRARY's format: MKL's serves exactly that row count,
    oneDNN's (reordered to its GEMM's blocked layout) any count beyond SMALL_M. `linear` then
    uses it. Returns the copy's bytes (0: nothing packed: too few rows for the GEMM path, another
    dtype, no such library).

    Why: a full decode batch (64 rows) reads every weight from memory each step, and a GEMM
    packs each weight again per call; from a packed copy it skips that work, with MKL and with
    oneDNN (`python -m client bench offline`; docs/decisions.md, "Packed weight copies"). It
    costs a second copy of the weights."""
    if rows <= SMALL_M or weight.dtype != torch.float32 or weight.dim() != 2:
        return 0
    if GEMM_LIBRARY == "onednn":
        if getattr(weight, "cpu_packed", (None,))[0] != "onednn":
            weight.cpu_packed = ("onednn", rows,
                                 torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows))
    elif not _mkl_packing():
        return 0
    elif getattr(weight, "cpu_packed", (None, None))[:2] != ("mkl", rows):
        weight.cpu_packed = ("mkl", rows,
                             torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows))
    return weight.numel() * weight.element_size()


# Exact block copies of float32 weights that are Q4_1 / Q8_0 blocks (the default model's
# layers / lm_head), read by linear's C++ GEMV and the fused decode layers instead of the
# float32 weight: same bits, a sixth / a quarter of the bytes (cpu_blocks.py).
# TPLLM_BLOCK_COPIES=0 keeps none (for comparisons).
keep_block_copy = (_blocks.keep_block_copy if hasattr(_ext, "small_m_linear_q8_into")
                   and os.environ.get("TPLLM_BLOCK_COPIES", "1").strip() != "0" else None)
# the most rows a GEMV reads a copy for (AVX2: 16; csrc block_copy_max_rows), asked once
_BLOCK_COPY_ROWS = _ext.block_copy_max_rows() if keep_block_copy is not None else 0


# A float32 decode step with LoRA adapter rows stays on the fused path: the bound layers carry
# each projection's stacked adapters and the step passes each row's adapter (lora_delta_). The
# model checks this flag.
FUSED_LORA = True


def lora_delta_(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                info: torch.Tensor, ids: torch.Tensor) -> bool:
    """y[m] += its adapter's delta of x[m] for each row m with one (ids[m] > 0), in place, from a
    linear's stacked adapters (lora_layers.LoraSlot.stacked; csrc/lora_delta.cpp), exactly as
    the fused decode layers add them. False (y untouched) where it does not apply: beyond the
    float32 GEMV's rows (a prefill's GEMMs: the caller groups rows by adapter), other storage,
    non-contiguous tensors."""
    if not (_small_m_f32(x, a) and y.dtype == torch.float32 and y.is_contiguous()):
        return False
    _ext.lora_delta_(x, y, a, bt, info, ids)
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # One pass with a vectorized exp; torch's silu-then-mul is two passes over a strided half,
    # which costs most at decode's few rows.
    if gate_up.dtype not in _STORAGE or gate_up.dim() != 2 or not gate_up.is_contiguous():
        return _ref.silu_mul(gate_up)
    return _ext.silu_mul(gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As add_rms_norm's norm (one C++ call; torch's is a composite dispatched op by op)."""
    if (x.dtype not in _STORAGE or weight.dtype != x.dtype or not x.is_contiguous()
            or not weight.is_contiguous() or weight.numel() != x.shape[-1]):
        return _ref.rms_norm(x, weight, eps)
    return _ext.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x, x = rms_norm(residual); both inputs are consumed."""
    if x.dtype not in _STORAGE or not (x.is_contiguous() and residual.is_contiguous()):
        return _ref.add_rms_norm(x, residual, weight, eps)
    _ext.add_rms_norm_(x, residual, weight, eps)
    return x, residual


AVAILABLE = _ext is not None
_BF16_GEMV = AVAILABLE and _ext.bf16_gemv_supported()
# the most rows a bf16 linear runs in the C++ GEMV (0 without it; beyond them it is oneDNN's)
_BF16_GEMV_ROWS = BF16_SMALL_M if _BF16_GEMV else 0
# A bf16 decode-only step of at most this many rows at one rank runs fused too (FUSED_DECODE):
# the rows the modular path's bf16 GEMV takes, so the fused layers run the same arithmetic
FUSED_DECODE_BF16_ROWS = _BF16_GEMV_ROWS
# the screened greedy head (greedy_argmax_screened) runs on the bf16 GEMV's tiles
GREEDY_SCREEN = _BF16_GEMV and hasattr(_ext, "greedy_argmax_screened")
# rows greedy_argmax_screened_q8 takes per pass over the int8 head (greedy_head.py caps at it)
Q8_SCREEN_INPUTS = _ext.q8_screen_inputs() if hasattr(_ext, "q8_screen_inputs") else 0


def begin_forward(rows: int, dtype: torch.dtype) -> None:
    """Before a forward pass of `rows` token rows: where its kernels' loops run (a pass whose
    linears are GEMMs runs them on OpenMP: cpu_threading.place_loops)."""
    gemv_rows = SMALL_M if dtype == torch.float32 else _BF16_GEMV_ROWS
    _threads.place_loops(rows > gemv_rows)


# The family parts (backend/model/family.py) outside the fused decode stack. GeGLU and the
# final cap are torch's ops, as the fused stack computes GeGLU too (csrc/elementwise.cpp).
gelu_tanh_mul = _ref.gelu_tanh_mul
soft_cap = _ref.soft_cap


def qk_norm_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q: int,
             num_kv: int, eps: float) -> torch.Tensor:
    """As the reference's, in C++ (the fused decode stack's kernel: the same bits on every
    path)."""
    if (qkv.dtype not in _STORAGE or not qkv.is_contiguous() or q_weight.dtype != qkv.dtype
            or k_weight.dtype != qkv.dtype):
        return _ref.qk_norm_(qkv, q_weight, k_weight, num_q, num_kv, eps)
    _ext.qk_norm_(qkv, q_weight, k_weight, num_q, num_kv, eps)
    return qkv
