"""Which of our parameters (and which shard of it) a checkpoint tensor fills.

Our linears merge what checkpoints keep apart (q/k/v into qkv_proj, gate/up into gate_up_proj:
one GEMV each per decode step); Phi-3's checkpoints merge them already, and each of their
qkv_proj / gate_up_proj tensors fills several shards, each from its own rows.
"""
from __future__ import annotations

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
# multimodal checkpoints' language model prefixes (Gemma 3), and the towers we do not load
_LANGUAGE_MODEL = ("model.language_model.", "language_model.model.", "language_model.")
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                 "model.multi_modal_projector.")


@dataclass(frozen=True)
class Target:
    param: str  # our parameter's name
    shard: str | None  # the shard of it (q, k, v, gate, up), None: all of it
    source_offset: int = 0  # where the shard's rows start in the checkpoint tensor (fused ones)


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
