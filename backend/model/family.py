"""What sets each decoder family apart from Llama's, in one place.

The loader, the torch path, the fused C++ decode stack and the GPU kernels all read a family's
Family record (through ModelConfig) instead of testing model_type: a new family that is Llama
plus known parts (a norm kind, an activation, q/k norms, sandwich norms, soft caps, a window
pattern, fused checkpoint tensors) is one entry here plus its test in tests/tiny_models.py.

Facts are as transformers' modeling files compute them (the reference we test against):
- Gemma's RMSNorm scales by (1 + w): `norm_offset` 1, folded into the weight at load.
- Gemma 2/3 put a norm after attention and after the MLP as well as before them
  (`sandwich_norms`); their checkpoints call the pre-MLP norm pre_feedforward_layernorm and
  the post-attention one post_attention_layernorm, which is Llama's name for the pre-MLP norm
  (`renames`).
- Qwen3 and Gemma 3 RMS-normalize each query and key head before rotary (`qk_norm`).
- Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj (`fused_checkpoint`).
- OLMoE RMS-normalizes the whole query and the whole key (all heads at once: `qk_norm_whole`).
- Mixtral, Qwen3-MoE and OLMoE replace the MLP by experts (`moe`, backend/model/moe.py): a
  router's softmax (float32) picks each token's top k; Mixtral always renormalizes the k
  weights (`moe_norm_topk`), the others when config.json's norm_topk_prob says so, and cast
  them to the model's dtype before weighting (`moe_weights_in_dtype`). Qwen3-MoE keeps dense
  MLPs at mlp_only_layers and off its decoder_sparse_step (`moe_layer_rule`) and sizes its
  experts by moe_intermediate_size (`moe_size_key`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_types: tuple[str, ...]  # config.json model_type values this entry reads
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + w)
    qk_norm: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the dtype
    fused_checkpoint: bool = False  # qkv_proj / gate_up_proj tensors, split at load
    qkv_bias_default: bool = False  # q/k/v carry biases without attention_bias (Qwen2)
    o_bias_follows_attention_bias: bool = True
    # checkpoint name part -> ours, applied before the merge of q/k/v and gate/up
    renames: tuple[tuple[str, str], ...] = ()
    # how config.json says which layers are windowed, when it has no layer_types:
    # "all" (every layer, when sliding_window is set), "qwen2" (use_sliding_window, from
    # max_window_layers on), "flagged" (every layer, with use_sliding_window: Qwen3-MoE),
    # "gemma2" (even layers), "gemma3" (all but every sliding_window_pattern-th), "none"
    window_rule: str = "all"
    activation_key: str = "hidden_act"  # which config field names the MLP activation
    default_activation: str = "silu"
    # transformers' config defaults for fields a released config.json may leave out
    defaults: tuple[tuple[str, object], ...] = ()
    # rope type names the family's config class reads as another type (Phi-3: su, yarn)
    rope_aliases: tuple[tuple[str, str], ...] = ()
    qk_norm_whole: bool = False  # one RMSNorm over all q heads, one over all k heads (OLMoE)
    # mixture of experts (backend/model/moe.py); the fields below it matter only where it is set
    moe: bool = False
    moe_norm_topk: bool | None = None  # renormalize the top k weights; None: norm_topk_prob
    moe_weights_in_dtype: bool = True  # the weights cast to the model dtype (else float32)
    moe_layer_rule: str = "all"  # "all", or "qwen3_moe": decoder_sparse_step, mlp_only_layers
    moe_size_key: str = "intermediate_size"  # which config field sizes an expert's MLP


_GEMMA_RENAMES = (
    # checkpoint -> ours: the pre-MLP norm keeps Llama's name (the kernels' norm2)
    ("post_attention_layernorm", "attn_out_norm"),
    ("pre_feedforward_layernorm", "post_attention_layernorm"),
    ("post_feedforward_layernorm", "mlp_out_norm"),
)

FAMILIES: dict[str, Family] = {}


def _register(f: Family) -> None:
    for t in f.model_types:
        FAMILIES[t] = f


_register(Family(("llama",), window_rule="none"))
_register(Family(("mistral",)))
_register(Family(("qwen2",), qkv_bias_default=True, o_bias_follows_attention_bias=False,
                 window_rule="qwen2"))
_register(Family(("qwen3",), qk_norm=True, window_rule="qwen2"))
_GEMMA_DEFAULTS = (("head_dim", 256), ("query_pre_attn_scalar", 256), ("sliding_window", 4096),
                   ("rms_norm_eps", 1e-6), ("tie_word_embeddings", True))
_register(Family(("gemma2",), norm_offset=1.0, sandwich_norms=True, embed_scale=True,
                 renames=_GEMMA_RENAMES, window_rule="gemma2",
                 activation_key="hidden_activation", default_activation="gelu_pytorch_tanh",
                 defaults=_GEMMA_DEFAULTS + (("attn_logit_softcapping", 50.0),
                                             ("final_logit_softcapping", 30.0))))
_register(Family(("gemma3_text", "gemma3"), norm_offset=1.0, qk_norm=True, sandwich_norms=True,
                 embed_scale=True, renames=_GEMMA_RENAMES, window_rule="gemma3",
                 activation_key="hidden_activation", default_activation="gelu_pytorch_tanh",
                 defaults=_GEMMA_DEFAULTS + (
                     ("vocab_size", 262208), ("num_attention_heads", 8),
                     ("num_key_value_heads", 4), ("max_position_embeddings", 131072),
                     ("sliding_window_pattern", 6), ("rope_theta", 1_000_000.0),
                     ("rope_local_base_freq", 10_000.0))))
_register(Family(("phi3",), fused_checkpoint=True,
                 defaults=(("original_max_position_embeddings", 4096),),
                 rope_aliases=(("su", "longrope"), ("yarn", "longrope"))))

# (no default expert counts: each family's config class reads both num_experts and
# num_local_experts, and a default under one would hide the other)
_register(Family(("mixtral",), renames=(("block_sparse_moe", "mlp"),), moe=True,
                 moe_norm_topk=True, moe_weights_in_dtype=False,
                 defaults=(("num_experts_per_tok", 2),)))
_register(Family(("qwen3_moe",), qk_norm=True, window_rule="flagged", moe=True,
                 moe_layer_rule="qwen3_moe", moe_size_key="moe_intermediate_size",
                 defaults=(("num_experts_per_tok", 8), ("moe_intermediate_size", 768))))
_register(Family(("olmoe",), qk_norm_whole=True, window_rule="none", moe=True,
                 defaults=(("num_experts_per_tok", 8),)))

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# MLP activations: silu (SwiGLU) and tanh-approximated GELU (GeGLU), by their config names
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_tanh": "gelu_tanh"}


def family_of(model_type: str) -> Family | None:
    return FAMILIES.get(model_type)


def layer_windows(family: Family, raw: dict, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: attends to the whole context), as transformers decides
    it: config.json's layer_types where it has them, else the family's rule."""
    window = raw.get("sliding_window") or 0
    if family.window_rule in ("qwen2", "flagged") and not raw.get("use_sliding_window", False):
        window = 0
    types = raw.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"unsupported layer_types {sorted(unknown)}; supported: "
                             "sliding_attention, full_attention")
        # sliding_attention layers without a window (Qwen2 without use_sliding_window, a null
        # sliding_window) attend to everything, as transformers runs them
        return tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    if not window or family.window_rule == "none":
        return (0,) * num_layers
    rule = family.window_rule
    if rule in ("all", "flagged"):
        return (int(window),) * num_layers
    if rule == "qwen2":
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else 0 for i in range(num_layers))
    if rule == "gemma2":
        return tuple(int(window) if i % 2 == 0 else 0 for i in range(num_layers))
    if rule == "gemma3":
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple(0 if (i + 1) % pattern == 0 else int(window) for i in range(num_layers))
    raise AssertionError(rule)
