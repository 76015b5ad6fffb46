"""The decoder's shape, read from a checkpoint's config.json.

Parsed from the raw JSON rather than through transformers' config classes: their field names
move between releases (rope_theta vs rope_parameters), the JSON on disk does not.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from backend.model.errors import ModelLoadError
from backend.model.family import (ACTIVATIONS, SUPPORTED_MODEL_TYPES, Family, family_of,
                                  layer_windows)
from backend.model.rope_scaling import SUPPORTED_ROPE_TYPES as ROPE_TYPES
from backend.parallel.partition import HeadPartition


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"  # silu | gelu_tanh (ACTIVATIONS' values)
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window; 0: the whole context
    attention_scale: float | None = None  # query scaling; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # Gemma 2's attention logit soft-capping (0: none)
    final_softcap: float = 0.0  # Gemma 2's final logit soft-capping (0: none)
    partial_rotary_factor: float = 1.0  # the share of each head's dims rotary turns (Phi-4-mini)
    original_max_position_embeddings: int | None = None  # longrope's switch (Phi-3)
    # windowed layers' own rope (Gemma 3's rope_local_base_freq); None: every layer's is global
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    # mixture of experts (backend/model/moe.py): the layers whose MLP is experts, how many
    # experts there are, how many each token takes, their MLP's width, and whether the chosen
    # weights are renormalized to sum to 1
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @property
    def family(self) -> Family:
        return family_of(self.model_type)

    @property
    def kv_window(self) -> int:
        """The window every layer has, where every layer has one (the narrowest: Mistral): the
        KV blocks behind it are never read again. 0 where some layer sees the whole context."""
        return min(self.layer_windows) if self.layer_windows and all(self.layer_windows) else 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: config.json not found") from None
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: unreadable config.json ({e})") from None
        try:
            return cls.from_dict(raw)
        except ModelLoadError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: missing or invalid field {e}") from None

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type", "")
        family = family_of(model_type)
        if family is None:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if model_type == "gemma3":  # the multimodal checkpoint: its language model
            raw = _gemma3_language_model(raw)
        # what transformers' config class assumes where config.json is silent (released Gemma
        # 3 text_configs leave most of it out)
        raw = {**dict(family.defaults), **raw}
        act = raw.get(family.activation_key) or raw.get("hidden_act") or family.default_activation
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"unsupported {family.activation_key} {act!r}; supported: "
                                 f"{', '.join(ACTIVATIONS)}")
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        layers = int(raw["num_hidden_layers"])
        rope = _rope(raw, dict(family.rope_aliases))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        try:
            windows = layer_windows(family, raw, layers)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        attn_bias = bool(raw.get("attention_bias") or False)
        scalar = raw.get("query_pre_attn_scalar")
        partial = float(rope.get("partial_rotary_factor") or 1.0)
        if not 0 < partial <= 1 or int(head_dim * partial) % 2:
            raise ModelLoadError(f"partial_rotary_factor {partial} of head_dim {head_dim}: "
                                 "rotary needs an even number of dims in (0, head_dim]")
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope["theta"],
            rope_scaling=rope["scaling"],
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias_default or attn_bias,
            o_bias=family.o_bias_follows_attention_bias and attn_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=ACTIVATIONS[act],
            layer_windows=windows,
            attention_scale=float(scalar) ** -0.5 if scalar else None,
            attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(raw.get("final_logit_softcapping") or 0.0),
            partial_rotary_factor=partial,
            original_max_position_embeddings=raw.get("original_max_position_embeddings"),
            local_rope_theta=rope.get("local_theta"),
            local_rope_scaling=rope.get("local_scaling"),
            **(_moe_fields(family, raw, layers) if family.moe else {}),
        )

    def kv_bytes_per_token(self, dtype_bytes: int, tp_size: int = 1) -> int:
        """Bytes of K and V cache one token takes on one rank (all layers)."""
        kv_local = max(HeadPartition.build(self.num_heads, self.num_kv_heads, r, tp_size).num_kv
                       for r in range(tp_size))
        return 2 * self.num_layers * kv_local * self.head_dim * dtype_bytes


# router options of MoE families we do not serve -> the values that mean "as we compute": a
# config.json that sets one otherwise is refused rather than routed differently
_ROUTER_NEUTRAL = {
    "scoring_func": ("softmax", None),  # DeepSeek's sigmoid scoring
    "topk_method": ("greedy", None),  # grouped top-k
    "n_group": (None, 0, 1), "topk_group": (None, 0, 1),
    "routed_scaling_factor": (None, 1, 1.0),
    "n_shared_experts": (None, 0),  # shared experts beside the routed ones
    "shared_expert_intermediate_size": (None, 0),
    "num_shared_experts": (None, 0),
    "clip_qkv": (None,),  # OLMoE's clamp of q, k and v
}


def _moe_fields(family: Family, raw: dict, num_layers: int) -> dict:
    """ModelConfig's MoE fields from an MoE family's config.json, as transformers reads it;
    router options we do not compute fail the load."""
    for key, neutral in _ROUTER_NEUTRAL.items():
        if raw.get(key) not in neutral:
            raise ModelLoadError(f"unsupported {key}={raw[key]!r} for a {raw['model_type']} "
                                 "model: only softmax top-k routing over the routed experts, "
                                 "without shared experts or clipping, is served")
    # Mixtral and Qwen3-MoE's config classes save num_local_experts, OLMoE's and released
    # Qwen3-MoE checkpoints num_experts
    experts = next((raw[k] for k in ("num_experts", "num_local_experts")
                    if raw.get(k) is not None), None)
    if experts is None:
        raise ModelLoadError("config.json names neither num_experts nor num_local_experts")
    experts, top_k = int(experts), int(raw["num_experts_per_tok"])
    if experts > 0 and not 1 <= top_k <= experts:
        raise ModelLoadError(f"num_experts_per_tok {top_k} of {experts} experts")
    layers = tuple(range(num_layers)) if experts > 0 else ()
    if family.moe_layer_rule == "qwen3_moe":
        step = int(raw.get("decoder_sparse_step") or 1)
        dense = set(raw.get("mlp_only_layers") or ())
        layers = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
    norm = family.moe_norm_topk
    return dict(moe_layers=layers, num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(raw[family.moe_size_key]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)) if norm is None else norm)


def _gemma3_language_model(raw: dict) -> dict:
    """A gemma3 (image + text) config.json: its text_config, for text prompts (the vision tower's
    tensors are skipped at load; requests with images are refused by the front end)."""
    if not isinstance(raw.get("text_config"), dict):
        raise ModelLoadError("gemma3 config.json without a text_config")
    text = dict(raw["text_config"])
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if key not in text and key in raw:
            text[key] = raw[key]
    text["model_type"] = "gemma3"
    return text


def _checked_scaling(params: dict | None, where: str, aliases: dict[str, str]) -> dict | None:
    """A rope dict if it scales (else None), its type named as we compute it, after checking
    we compute it."""
    params = dict(params or {})
    kind = params.pop("type", None) or params.get("rope_type") or "default"
    kind = aliases.get(kind, kind)
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported {where} rope type {kind!r}; supported: "
                             f"{', '.join(ROPE_TYPES)}")
    params["rope_type"] = kind
    return params if kind != "default" else None


def _rope(raw: dict, aliases: dict[str, str]) -> dict:
    """theta and scaling of global layers (and of windowed ones where they have their own), from
    either spelling on disk: rope_theta + rope_scaling (+ Gemma 3's rope_local_base_freq), or
    transformers 5's rope_parameters (flat, or per layer type)."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # per layer type
        glob = params.get("full_attention") or {}
        local = params.get("sliding_attention")
        out = {"theta": float(glob.get("rope_theta") or raw.get("rope_theta") or 10000.0),
               "scaling": _checked_scaling(glob, "full_attention", aliases),
               "partial_rotary_factor": glob.get("partial_rotary_factor")}
        if local is not None:
            out["local_theta"] = float(local.get("rope_theta") or 10000.0)
            out["local_scaling"] = _checked_scaling(local, "sliding_attention", aliases)
        return out
    scaling = raw.get("rope_scaling") or params
    out = {"theta": float(raw.get("rope_theta") or params.get("rope_theta")
                          or (raw.get("rope_scaling") or {}).get("rope_theta") or 10000.0),
           "scaling": _checked_scaling(scaling, "rope_scaling", aliases),
           "partial_rotary_factor": raw.get("partial_rotary_factor")
           or params.get("partial_rotary_factor")}
    if raw.get("rope_local_base_freq") is not None:  # Gemma 3 before transformers 5
        out["local_theta"] = float(raw["rope_local_base_freq"])
        out["local_scaling"] = None
    return out
