"""Self-attention over the paged KV cache, and the per-step metadata that drives it.

A step's tokens are laid out decodes first (one token each), then prefill chunks (contiguous
runs of one sequence's tokens). All linears run once over the whole flat batch; only the
attention core splits by kind.
"""
from __future__ import annotations

from types import ModuleType

import torch

from backend.model.config import ModelConfig
from backend.model.layers import (ColumnParallelLinear, DirectModule, RMSNorm, RowParallelLinear,
                                  WholeQKNorm)
from backend.parallel.context import ParallelContext
from backend.parallel.partition import HeadPartition
from tpllm_kernels import reference
from tpllm_kernels.metadata import AttentionMetadata


class Attention(DirectModule):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 ops: ModuleType = reference, layer: int = 0):
        super().__init__()
        self.ops = ops  # the kernel namespace, chosen once per model (tpllm_kernels.select_ops)
        part = HeadPartition.build(cfg.num_heads, cfg.num_kv_heads, ctx.rank, ctx.world_size)
        d = cfg.head_dim
        self.head_dim, self.num_q, self.num_kv = d, part.num_q, part.num_kv
        self.scale = cfg.attention_scale or d ** -0.5
        # this layer's sliding window (0: none) and logit cap (0: none); a windowed layer
        # rotates with the local rope where the family has one (metadata.rope)
        self.window = cfg.layer_windows[layer] if cfg.layer_windows else 0
        self.softcap = cfg.attn_softcap
        self.local_rope = self.window > 0
        # per-head RMSNorm weights of q and k (Qwen3, Gemma 3), every head's the same [D]
        self.q_norm = self.k_norm = self.qk_whole = None
        if cfg.family.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, ops)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, ops)
        elif cfg.family.qk_norm_whole:  # OLMoE: over all heads, each rank its heads' share
            q_width, k_width = cfg.num_heads * d, cfg.num_kv_heads * d
            self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps, dtype, ops,
                                  rows=(part.q_start * d, part.q_end * d))
            self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps, dtype, ops,
                                  rows=(part.kv_start * d, part.kv_end * d))
            self.qk_whole = WholeQKNorm(part.num_q, part.num_kv, d, part.owned_kv,
                                        (q_width, k_width), cfg.rms_norm_eps, ctx)
        kv_rows = (part.kv_start * d, part.kv_end * d)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, {"q": (part.q_start * d, part.q_end * d), "k": kv_rows, "v": kv_rows},
            bias=cfg.qkv_bias, dtype=dtype, ops=ops)
        self.o_proj = RowParallelLinear((part.q_start * d, part.q_end * d), cfg.hidden_size,
                                        bias=cfg.o_bias, dtype=dtype, ctx=ctx, ops=ops)
        # Uneven head splits under TP break GQA's equal groups: map each query head explicitly.
        self.kv_index = None if part.uniform_groups else torch.tensor(part.kv_index_for_q())

    def forward(self, x: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t, d, hq, hkv, ops = x.shape[0], self.head_dim, self.num_q, self.num_kv, self.ops
        k_cache, v_cache = kv_cache
        qkv = self.qkv_proj(x)
        if self.qk_whole is not None:
            qkv = self.qk_whole(qkv, self.q_norm.weight, self.k_norm.weight)
        elif self.q_norm is not None:
            qkv = ops.qk_norm_(qkv, self.q_norm.weight, self.k_norm.weight, hq, hkv,
                               self.q_norm.eps)
        cos, sin = meta.rope(self.local_rope)
        q, k, v = ops.rotary_write_kv(qkv, cos, sin, hq, hkv, k_cache, v_cache,
                                      meta.slot_mapping)
        n = meta.num_decodes
        opts = self.options()
        if not meta.prefills:
            out = ops.decode_attention(q, k_cache, v_cache, meta.decode, self.scale, self.kv_index,
                                       **opts)
        else:
            # padding rows past the last chunk get no attention: zeros, not garbage
            out = torch.zeros_like(q) if meta.num_padding else torch.empty_like(q)
            if n:
                out[:n] = ops.decode_attention(q[:n], k_cache, v_cache, meta.decode, self.scale,
                                               self.kv_index, **opts)
            for c in meta.prefills:
                sl = slice(c.start, c.start + c.length)
                out[sl] = ops.prefill_attention(q[sl], k[sl], v[sl], k_cache, v_cache, c,
                                                self.scale, self.kv_index, **opts)
        return self.o_proj(out.reshape(t, hq * d))

    def options(self) -> dict:
        """The attention kernels' window and softcap keywords, where this layer sets them (the
        kernels of a plain layer are called exactly as before)."""
        opts = {}
        if self.window:
            opts["window"] = self.window
        if self.softcap:
            opts["softcap"] = self.softcap
        return opts
