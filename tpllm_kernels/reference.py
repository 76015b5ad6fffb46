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


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: DecodeBatch, scale: float,
                     kv_index: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence. q: [B, Hq, D]. Returns [B, Hq, D]."""
    b = q.shape[0]
    _, bs, h, d = k_cache.shape
    length = batch.max_context if batch.mask is None else batch.num_blocks * bs
    k = k_cache.index_select(0, batch.gather_index).view(b, -1, h, d)[:, :length]
    v = v_cache.index_select(0, batch.gather_index).view(b, -1, h, d)[:, :length]
    out = _sdpa(q.unsqueeze(2), _heads_first(k, kv_index), _heads_first(v, kv_index),
                batch.mask, False, scale)
    return out.squeeze(2)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
                      kv_index: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk of one sequence's prompt: q/k/v [Tq, H, D] are its newest tokens (already written to
    the cache); the chunk attends causally to every cached token of its sequence and itself."""
    if chunk.mask is not None:  # a cached prefix: read the whole context from the cache
        _, bs, h, d = k_cache.shape
        nblk = -(-chunk.context_len // bs)
        k = k_cache.index_select(0, chunk.block_table[:nblk]).view(-1, h, d)[:chunk.context_len]
        v = v_cache.index_select(0, chunk.block_table[:nblk]).view(-1, h, d)[:chunk.context_len]
    # 4-D inputs: the 3-D form falls back to the slow unfused math path on CPU
    out = _sdpa(q.transpose(0, 1)[None], _heads_first(k, kv_index)[None],
                _heads_first(v, kv_index)[None], chunk.mask, chunk.mask is None, scale)
    return out[0].transpose(0, 1)
