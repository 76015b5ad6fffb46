"""The fused decode path's Python side (csrc/decode_layer.cpp): a layer's weights, block copies,
caches and LoRA adapters bound once (decode_layer), then a decode-only step's layers run as one
C++ call at one rank (decode_stack), as halves ending in shared-memory all-reduces under tensor
parallelism (decode_stack_tp), or half by half when the collectives go through Python
(decode_attention_half, decode_mlp_half). Bit-identical to the modular path: the same kernels
in the same order. cpu_ops re-exports these names, the namespace the model calls as `ops.`."""
from __future__ import annotations

import torch

from tpllm_kernels.cpu_ext import load
from tpllm_kernels.metadata import DecodeBatch, uniform_kv_index

_ext = load()

# A decode-only float32 step may run each decoder layer as two C++ calls instead of ~10
# Python-level ones, or with one rank all layers as one. The model checks this flag.
FUSED_DECODE = True
# ...and so do layers with their family's parts (decode_layer's `family`)
FUSED_FAMILY_PARTS = True

_COPY_BITS = {"q4": 4, "q8": 8}  # DecodeLayer's name for a block copy's kind


def decode_layer(norm1: torch.Tensor, eps1: float, qkv_weight: torch.Tensor,
                 qkv_bias: torch.Tensor | None, num_q: int, num_kv: int, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, scale: float, kv_index: torch.Tensor | None,
                 o_weight: torch.Tensor, o_bias: torch.Tensor | None, norm2: torch.Tensor,
                 eps2: float, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
                 down_weight: torch.Tensor, down_bias: torch.Tensor | None,
                 lora: list | None = None, family: dict | None = None):
    """One layer's weights and caches, bound for decode_stack and the decode halves; lora:
    qkv's, o's, gate_up's and down's stacked adapters (LoraSlot.stacked: (a, bt, info)) or None
    each, for steps with adapter rows (cpu_ops.lora_delta_); family: what the layer's family
    adds to Llama's (DecoderLayer.family_parts: q_norm, k_norm, attn_out_norm, mlp_out_norm,
    gelu, window, softcap, local_rope; csrc/decode_layer.cpp's FamilyParts)."""
    if kv_index is None:
        kv_index = uniform_kv_index(num_q, num_kv)
    # each weight's exact block copy where it has one (cpu_blocks.py): kind 4 or 8 (0: none)
    # and its codes and scales
    copies = [getattr(w, "block_copy", ("", None, None))
              for w in (qkv_weight, o_weight, gate_up_weight, down_weight)]
    layer = _ext.DecodeLayer(norm1, eps1, qkv_weight, qkv_bias, num_q, num_kv, k_cache, v_cache,
                             scale, kv_index, o_weight, o_bias, norm2, eps2, gate_up_weight,
                             gate_up_bias, down_weight, down_bias,
                             [_COPY_BITS.get(c[0], 0) for c in copies],
                             [t for c in copies for t in c[1:]],
                             [t for s in (lora or ()) for t in (s or (None, None, None))])
    if family:
        f = family
        layer.set_family_parts(f.get("q_norm"), f.get("k_norm"), f.get("attn_out_norm"),
                               f.get("mlp_out_norm"), bool(f.get("gelu")),
                               int(f.get("window", 0)), float(f.get("softcap", 0.0)),
                               bool(f.get("local_rope")))
    return layer


def decode_stack(layers: list, x: torch.Tensor, residual: torch.Tensor, add_residual: bool,
                 cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                 batch: DecodeBatch, lora_ids: torch.Tensor | None = None,
                 local_cos: torch.Tensor | None = None, local_sin: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every bound layer in one call (one rank: no collectives between layers). lora_ids: each
    row's LoRA adapter (0: none; int64), None when no row has one; local_cos / local_sin: the
    windowed layers' own rotary tables where they have their own (AttentionMetadata)."""
    x, residual = _ext.decode_stack(layers, x, residual, add_residual, cos, sin, slot_mapping,
                                    batch.block_tables, batch.context_lens, lora_ids,
                                    local_cos, local_sin)
    return x, residual


def decode_stack_tp(layers: list, x: torch.Tensor, residual: torch.Tensor, add_residual: bool,
                    cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                    batch: DecodeBatch, start: int, collectives: tuple,
                    lora_ids: torch.Tensor | None = None, local_cos: torch.Tensor | None = None,
                    local_sin: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, int, bool, float]:
    """decode_stack for one tensor-parallel rank: layer halves [start, 2 * layers), each ending
    in its shared-memory all-reduce; collectives = (buffers, flags, rank, first seq, spins) from
    ParallelContext.fused_stack; lora_ids as decode_stack's. Returns (x, residual, halves run,
    arrived, seconds)."""
    buffers, flags, rank, seq, spins = collectives
    return _ext.decode_stack_tp(layers, x, residual, add_residual, cos, sin, slot_mapping,
                                batch.block_tables, batch.context_lens, start, list(buffers),
                                flags, rank, seq, spins, lora_ids, local_cos, local_sin)


def decode_attention_half(layer, x: torch.Tensor, residual: torch.Tensor, add_residual: bool,
                          cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                          batch: DecodeBatch, collective: tuple | None = None,
                          lora_ids: torch.Tensor | None = None,
                          local_cos: torch.Tensor | None = None,
                          local_sin: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, bool, float]:
    """A bound layer's [add + RMSNorm], qkv, rotary + KV write, attention and o_proj's partial
    sum (no bias: it follows the all-reduce); with a shared-memory `collective` (see
    ShmCommunicator.fused_collective) also the all-reduce; lora_ids as decode_stack's. Returns
    (out, residual, arrived, seconds in the collective); out is this rank's partial unless all
    ranks arrived."""
    return _ext.decode_attention_half(layer, x, residual, add_residual, cos, sin, slot_mapping,
                                      batch.block_tables, batch.context_lens, collective,
                                      lora_ids, local_cos, local_sin)


def decode_mlp_half(layer, x: torch.Tensor, residual: torch.Tensor,
                    collective: tuple | None = None, lora_ids: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, bool, float]:
    """A bound layer's add + RMSNorm, gate_up, silu * up and down_proj's partial sum (no bias),
    [and the all-reduce], with LoRA deltas as decode_attention_half's; returns as it."""
    return _ext.decode_mlp_half(layer, x, residual, collective, lora_ids)
