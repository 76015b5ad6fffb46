"""Plain torch implementations of every kernel: the CPU path and the reference for the GPU kernels.

Paged KV layout, per layer: k_cache / v_cache are [num_blocks, block_size, num_kv_heads, head_dim];
token t of a sequence lives in block block_table[t // block_size] at row t % block_size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x; returns (rms_norm(residual), residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox/HF-style rotation (halves, not interleaved). q/k: [T, H, D]; cos/sin: [T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    return rot(q), rot(k)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new tokens' K/V ([T, Hkv, D]) at their cache slots."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k)
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v)


def _expand_kv(x: torch.Tensor, kv_index: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """x: [..., Hkv, L, D]. Uneven GQA splits (TP) expand KV per query head; uniform ones use GQA."""
    if kv_index is None:
        return x, True
    return x.index_select(-3, kv_index), False


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens as [Hkv, length, D]."""
    nblk = (length + cache.shape[1] - 1) // cache.shape[1]
    x = cache.index_select(0, block_table[:nblk]).flatten(0, 1)[:length]
    return x.transpose(0, 1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, max_context: int,
                     scale: float, kv_index: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence. q: [B, Hq, D]; block_tables [B, >=ceil(max_context/bs)];
    context_lens [B] include the query token itself. Returns [B, Hq, D]."""
    b, hq, d = q.shape
    bs = k_cache.shape[1]
    nblk = (max_context + bs - 1) // bs
    tables = block_tables[:, :nblk]
    # [B, nblk, bs, Hkv, D] -> [B, Hkv, L, D]
    k = k_cache[tables].flatten(1, 2).transpose(1, 2)
    v = v_cache[tables].flatten(1, 2).transpose(1, 2)
    k, gqa = _expand_kv(k, kv_index)
    v, _ = _expand_kv(v, kv_index)
    pos = torch.arange(k.shape[2])
    mask = (pos[None, :] < context_lens[:, None]).view(b, 1, 1, -1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=gqa and k.shape[1] != hq)
    return out.squeeze(2)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, block_table: torch.Tensor, context_len: int,
                      scale: float, kv_index: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk of one sequence's prompt: q/k/v [Tq, H, D] are its newest tokens (already written to
    the cache); the chunk sees all `context_len` tokens before and including it, causally."""
    tq = q.shape[0]
    qh = q.transpose(0, 1)
    if context_len == tq:  # no cached prefix: attend to the chunk itself
        kh, vh = k.transpose(0, 1), v.transpose(0, 1)
        mask, causal = None, True
    else:
        kh = gather_kv(k_cache, block_table, context_len)
        vh = gather_kv(v_cache, block_table, context_len)
        qpos = torch.arange(context_len - tq, context_len)
        mask, causal = torch.arange(context_len)[None, :] <= qpos[:, None], False
    kh, gqa = _expand_kv(kh, kv_index)
    vh, _ = _expand_kv(vh, kv_index)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=gqa and kh.shape[0] != qh.shape[0])
    return out.transpose(0, 1)
