"""Which of our parameters (and which shard of it) a checkpoint tensor fills.

Our linears merge what checkpoints keep apart (q/k/v into qkv_proj, gate/up into gate_up_proj:
one GEMV each per decode step); Phi-3's checkpoints merge them already, and each of their
qkv_proj / gate_up_proj tensors fills several shards, each from its own rows.

MoE layers stack their experts (moe.Experts: mlp.experts.gate_up_proj [E, 2I, H], down_proj
[E, H, I]). Released checkpoints keep one tensor per expert and projection (Mixtral's
block_sparse_moe.experts.N.w1 / w3 / w2, Qwen3-MoE's and OLMoE's mlp.experts.N.gate_proj /
up_proj / down_proj), which each fill expert N's slice; checkpoints holding transformers' stacked
tensors fill every expert at once.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from backend.model.config import ModelConfig

# checkpoint name part -> (our parameter name part, shard id within the merged parameter)
_MERGED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}
# one expert's projection (after the family's renames) -> (the stacked parameter, shard id)
_EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight")
_EXPERT_PART = {"gate_proj": ("gate_up_proj", "gate"), "w1": ("gate_up_proj", "gate"),
                "up_proj": ("gate_up_proj", "up"), "w3": ("gate_up_proj", "up"),
                "down_proj": ("down_proj", None), "w2": ("down_proj", None)}
# multimodal checkpoints' language model prefixes (Gemma 3), and the towers we do not load
_LANGUAGE_MODEL = ("model.language_model.", "language_model.model.", "language_model.")
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                 "model.multi_modal_projector.")


@dataclass(frozen=True)
class Target:
    param: str  # our parameter's name
    shard: str | None  # the shard of it (q, k, v, gate, up), None: all of it
    source_offset: int = 0  # where the shard's rows start in the checkpoint tensor (fused ones)
    expert: int | None = None  # the expert whose slice of a stacked parameter it fills


def checkpoint_targets(name: str, cfg: ModelConfig) -> list[Target]:
    """The targets of checkpoint tensor `name`; none for a tensor we skip (rotary caches, a
    tied lm_head, a vision tower)."""
    if name.startswith(_OTHER_TOWERS):
        return []
    for prefix in _LANGUAGE_MODEL:
        if name.startswith(prefix):
            name = "model." + name.removeprefix(prefix)
            break
    name = name.removeprefix("model.")
    if "rotary_emb" in name or (name.startswith("lm_head.") and cfg.tie_word_embeddings):
        return []
    for src, dst in cfg.family.renames:
        if f".{src}." in f".{name}.":
            name = name.replace(src, dst)
            break
    if cfg.family.moe and ".mlp.experts." in name:
        return _expert_targets(name, cfg)
    if cfg.family.fused_checkpoint:
        fused = _fused_targets(name, cfg)
        if fused is not None:
            return fused
    for src, (dst, shard) in _MERGED.items():
        if f".{src}." in f".{name}":
            return [Target(name.replace(src, dst), shard)]
    return [Target(name, None)]


def _fused_targets(name: str, cfg: ModelConfig) -> list[Target] | None:
    """Phi-3's qkv_proj (q rows, then k's, then v's) and gate_up_proj (gate, then up)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if ".self_attn.qkv_proj." in f".{name}":
        return [Target(name, "q", 0), Target(name, "k", q), Target(name, "v", q + kv)]
    if ".mlp.gate_up_proj." in f".{name}":
        return [Target(name, "gate", 0), Target(name, "up", cfg.intermediate_size)]
    return None


def _expert_targets(name: str, cfg: ModelConfig) -> list[Target]:
    """An MoE layer's experts: one expert's projection, or transformers' stacked gate_up_proj
    (every expert's gate rows, then its up rows) and down_proj."""
    m = _EXPERT.fullmatch(name)
    if m is not None and m.group(3) in _EXPERT_PART:
        param, shard = _EXPERT_PART[m.group(3)]
        return [Target(f"{m.group(1)}.{param}", shard, expert=int(m.group(2)))]
    if name.endswith(".mlp.experts.gate_up_proj"):
        return [Target(name, "gate", 0), Target(name, "up", cfg.moe_intermediate_size)]
    return [Target(name, None)]  # down_proj, or a name the loader then reports as unexpected
