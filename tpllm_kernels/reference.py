"""Plain torch implementations of every kernel: the CPU path and the reference for the GPU kernels.

Paged KV layout, per layer: k_cache / v_cache are [num_blocks, block_size, num_kv_heads, head_dim];
token t of a sequence lives in block block_table[t // block_size] at row t % block_size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpllm_kernels.metadata import DecodeBatch, PrefillChunk


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x; returns (rms_norm(residual), residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox/HF-style rotation (halves, not interleaved) of x: [T, H, D]; cos/sin: [T, D].
    Callers rotate q and k heads together in one call (they are adjacent in the qkv output)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new tokens' K/V ([T, Hkv, D]) at their cache slots."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k)
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v)


def rotary_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int,
                    num_kv: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused qkv projection [T, (Hq + 2 Hkv) D] into q, k, v ([T, H, D] each), rotate
    q and k (adjacent in qkv: one call) and store k, v in the paged cache."""
    t, d = qkv.shape[0], cos.shape[-1]
    qk = rotary(qkv[:, :(num_q + num_kv) * d].view(t, num_q + num_kv, d), cos, sin)
    q, k = qk[:, :num_q], qk[:, num_q:]
    v = qkv[:, (num_q + num_kv) * d:].view(t, num_kv, d)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k, v


def _heads_first(x: torch.Tensor, kv_index: torch.Tensor | None) -> torch.Tensor:
    """[..., L, Hkv, D] -> [..., H, L, D]; uneven GQA splits (TP) expand KV per query head."""
    x = x.transpose(-3, -2)
    return x if kv_index is None else x.index_select(-3, kv_index)


def _sdpa(q, k, v, mask, causal, scale):
    gqa = q.shape[-3] != k.shape[-3]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=gqa)


def _capped_attention(q, k, v, mask, scale, softcap):
    """Attention with Gemma 2's logit soft-cap, explicitly in float32: scores (q . k) * scale,
    capped softcap * tanh(s / softcap), masked (mask: True = attend), softmax, @ v."""
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq != hkv:  # GQA as SDPA's enable_gqa: query head h reads KV head h // (hq // hkv)
        k, v = k.repeat_interleave(hq // hkv, dim=-3), v.repeat_interleave(hq // hkv, dim=-3)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def _attend(q, k, v, mask, scale, softcap):
    """SDPA with a boolean mask, or the explicit capped form where softcap is set."""
    if softcap:
        return _capped_attention(q, k, v, mask, scale, softcap)
    return _sdpa(q, k, v, mask, False, scale)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: DecodeBatch, scale: float, kv_index: torch.Tensor | None = None, *,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One query token per sequence. q: [B, Hq, D]. Returns [B, Hq, D]. window: a sequence of
    L tokens (its query at position L - 1) sees keys [L - window, L) only (0: all); softcap:
    logits softcap * tanh(logit / softcap) (0: none)."""
    b = q.shape[0]
    _, bs, h, d = k_cache.shape
    if not window and not softcap:
        length = batch.max_context if batch.mask is None else batch.num_blocks * bs
        k = k_cache.index_select(0, batch.gather_index).view(b, -1, h, d)[:, :length]
        v = v_cache.index_select(0, batch.gather_index).view(b, -1, h, d)[:, :length]
        out = _sdpa(q.unsqueeze(2), _heads_first(k, kv_index), _heads_first(v, kv_index),
                    batch.mask, False, scale)
        return out.squeeze(2)
    k = k_cache.index_select(0, batch.gather_index).view(b, -1, h, d)
    v = v_cache.index_select(0, batch.gather_index).view(b, -1, h, d)
    lens = batch.context_lens[:, None]
    pos = torch.arange(k.shape[1], device=lens.device)[None, :]
    mask = pos < lens
    if window:
        mask &= pos >= lens - window
    out = _attend(q.unsqueeze(2), _heads_first(k, kv_index), _heads_first(v, kv_index),
                  mask.view(b, 1, 1, -1), scale, softcap)
    return out.squeeze(2)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
                      kv_index: torch.Tensor | None = None, *, window: int = 0,
                      softcap: float = 0.0) -> torch.Tensor:
    """A chunk of one sequence's prompt: q/k/v [Tq, H, D] are its newest tokens (already written to
    the cache); the chunk attends causally to every cached token of its sequence and itself.
    window: position p sees keys (p - window, p] only (0: all); softcap: logits
    softcap * tanh(logit / softcap) (0: none)."""
    if not window and not softcap:
        if chunk.mask is not None:  # a cached prefix: read the whole context from the cache
            _, bs, h, d = k_cache.shape
            nblk = -(-chunk.context_len // bs)
            k = k_cache.index_select(0, chunk.block_table[:nblk]).view(-1, h, d)[:chunk.context_len]
            v = v_cache.index_select(0, chunk.block_table[:nblk]).view(-1, h, d)[:chunk.context_len]
        # 4-D inputs: the 3-D form falls back to the slow unfused math path on CPU
        out = _sdpa(q.transpose(0, 1)[None], _heads_first(k, kv_index)[None],
                    _heads_first(v, kv_index)[None], chunk.mask, chunk.mask is None, scale)
        return out[0].transpose(0, 1)
    ctx = chunk.context_len
    first = ctx - chunk.length  # the chunk's first position
    # keys from the first one any row of the chunk sees: the chunk's own k/v where that is in the
    # chunk, else read from the cache
    lo = max(0, first + 1 - window) if window else 0
    if lo >= first:
        k, v = k[lo - first:], v[lo - first:]
    else:
        _, bs, h, d = k_cache.shape
        blocks = chunk.block_table[lo // bs:-(-ctx // bs)]
        skip = lo // bs * bs
        k = k_cache.index_select(0, blocks).view(-1, h, d)[lo - skip:ctx - skip]
        v = v_cache.index_select(0, blocks).view(-1, h, d)[lo - skip:ctx - skip]
    qpos = torch.arange(first, ctx, device=q.device)[:, None]
    kpos = torch.arange(lo, ctx, device=q.device)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    out = _attend(q.transpose(0, 1)[None], _heads_first(k, kv_index)[None],
                  _heads_first(v, kv_index)[None], mask, scale, softcap)
    return out[0].transpose(0, 1)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate, tanh approximation) * up, gate the first half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def qk_norm_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q: int,
             num_kv: int, eps: float) -> torch.Tensor:
    """RMSNorm of every query and key head (Qwen3, Gemma 3) in the fused qkv projection
    [T, (Hq + 2 Hkv) D], in place, before rotary; each head's dims share one weight [D]."""
    t, d = qkv.shape[0], q_weight.shape[0]
    q = qkv[:, :num_q * d].reshape(t, num_q, d)
    k = qkv[:, num_q * d:(num_q + num_kv) * d].reshape(t, num_kv, d)
    qkv[:, :num_q * d] = F.rms_norm(q, (d,), q_weight, eps).view(t, -1)
    qkv[:, num_q * d:(num_q + num_kv) * d] = F.rms_norm(k, (d,), k_weight, eps).view(t, -1)
    return qkv


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), as transformers caps Gemma 2's final logits (float32)."""
    return torch.tanh(x / cap) * cap
