"""What each llama.cpp GGUF architecture stores differently from a Hugging Face checkpoint.

llama.cpp's convert_hf_to_gguf.py writes these; its loader (llama-model.cpp) fills in what the
converter leaves out, and so do we, the same way:
- llama: q/k rows permuted per head to GGML's interleaved rotary layout (undone here).
- qwen3: q/k as in HF (no permutation); per-head RMSNorm weights attn_q_norm / attn_k_norm;
  head_dim in attention.key_length.
- gemma2 / gemma3: every RMSNorm weight stored as (w + 1), HF's w with Gemma's 1 + w folded in
  (undone here: see undo_norm_offset); sandwich norms (post_attention_norm, ffn_norm before the
  MLP, post_ffw_norm); tied embeddings (gemma2 never writes an output tensor). Not stored:
  query_pre_attn_scalar (llama.cpp: head_dim, or hidden / heads for the 27B models; a GGUF may
  say otherwise in attention.scale), the window pattern (gemma2: every other layer, gemma3:
  five of every six; attention.sliding_window_pattern may say otherwise), gemma3's local rope
  base (10000; rope.freq_base_swa where newer converters write it). gemma3's converter also
  drops the embedding rows past the tokenizer's vocabulary (vocab_size: the embedding's rows).
- phi3: q/k/v fused as attn_qkv, gate/up fused as ffn_up (gate rows first); longrope factors as
  the rope_factors_long / rope_factors_short tensors beside rope.scaling.original_context_length
  and rope.scaling.attn_factor; partial rotary as rope.dimension_count < head_dim.
- Mixture of experts: Mixtral (architecture llama with expert_count > 0: q/k permuted as llama's),
  qwen3moe (qwen3's per-head q/k norms) and olmoe (q/k norms over all heads: attn_q_norm
  [heads * head_dim], attn_k_norm [kv heads * head_dim]; no permutation). Every layer is MoE:
  the router as ffn_gate_inp [experts, hidden] (float32), each projection's experts stacked into
  one tensor [experts, rows, cols] (ffn_gate_exps, ffn_up_exps, ffn_down_exps), which we write
  back as the released checkpoints' one tensor per expert (Mixtral's block_sparse_moe.experts.N.
  w1 / w3 / w2, the others' mlp.experts.N.gate_proj / up_proj / down_proj). expert_count and
  expert_used_count give the experts and top k; qwen3moe sizes its experts by
  expert_feed_forward_length (llama.cpp: feed_forward_length / top k where it is missing).
  Not stored, because llama.cpp's graphs fix them: renormalizing the top k weights (Mixtral and
  qwen3moe always, olmoe never), the llama graph's lack of a sliding window, qwen3moe's lack of
  dense layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from backend.model.errors import ModelLoadError

_LLAMA_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's checkpoints call the norm after attention post_attention_layernorm, and the pre-MLP
# one (GGUF's ffn_norm, Llama's post_attention_layernorm) pre_feedforward_layernorm
_GEMMA_LAYER = {
    **_LLAMA_LAYER, "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {**_LLAMA_LAYER, "attn_qkv": "self_attn.qkv_proj"}
# an MoE layer: attention as llama's, the router instead of the MLP (its experts: _EXPERT_PARTS)
_ATTN_LAYER = {k: v for k, v in _LLAMA_LAYER.items() if not k.startswith(("ffn_gate", "ffn_up",
                                                                          "ffn_down"))}
_MOE_LAYER = {**_ATTN_LAYER, "ffn_gate_inp": "mlp.gate"}
_MIXTRAL_LAYER = {**_ATTN_LAYER, "ffn_gate_inp": "block_sparse_moe.gate"}
# blk.N.<part> [experts, rows, cols] -> the projection each expert's slice is
_EXPERT_PARTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
_MIXTRAL_EXPERTS = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# gemma's 27B models, which llama.cpp scales queries by hidden / heads instead of head_dim
_BIG_GEMMA_LAYERS = {"gemma2": 46, "gemma3": 62}
# what llama.cpp assumes where a gemma GGUF is silent (llama-model.cpp)
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}


class Meta:
    """A GGUF file's metadata (arch-prefixed keys by call, others by field) and small tensors."""

    def __init__(self, reader: Any, path: Path, arch: str) -> None:
        self.reader, self.path, self.arch = reader, path, arch

    def field(self, key: str, default: Any = ...) -> Any:
        return read_field(self.reader, self.path, key, default)

    def __call__(self, key: str, default: Any = ...) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def tensor(self, name: str) -> np.ndarray | None:
        from gguf.quants import dequantize

        for t in self.reader.tensors:
            if t.name == name:
                return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
        return None


def read_field(reader: Any, path: Path, key: str, default: Any = ...) -> Any:
    found = reader.fields.get(key)
    if found is None:
        if default is ...:
            raise ModelLoadError(f"{path}: GGUF metadata lacks required key {key!r}")
        return default
    return found.contents()


@dataclass(frozen=True)
class GgufArch:
    name: str  # general.architecture
    hf_class: str  # config.json architectures
    model_type: str
    per_layer: dict[str, str]  # blk.N.<part> -> model.layers.N.<HF part>
    permute_qk: bool = False  # llama's converter reorders q/k rows (unpermute)
    norm_offset: float = 0.0  # norms stored as (w + norm_offset)
    configure: Callable[[Meta, dict], None] = lambda meta, config: None
    partial_rotary: bool = False  # rope.dimension_count may be below head_dim
    rope_types: tuple[str, ...] = ("none", "linear")  # rope.scaling.type values we read
    config_tensors: tuple[str, ...] = ()  # read into config.json, not weights
    experts: str = ""  # an MoE layer's experts, as the HF checkpoint prefixes them; "": dense
    expert_names: tuple[tuple[str, str], ...] = ()  # the family's names of gate/up/down_proj


def _gemma(meta: Meta, config: dict) -> None:
    arch, layers = meta.arch, config["num_hidden_layers"]
    config.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                  query_pre_attn_scalar=_query_pre_attn_scalar(meta, config))
    window = meta("attention.sliding_window", 4096 if arch == "gemma2" else None)
    sliding = _sliding_layers(meta, layers) if window else [False] * layers
    config["sliding_window"] = int(window) if window else None
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    if arch == "gemma2":  # llama.cpp's defaults where the keys are missing, as transformers'
        config["attn_logit_softcapping"] = float(meta("attn_logit_softcapping", 50.0))
        config["final_logit_softcapping"] = float(meta("final_logit_softcapping", 30.0))
    else:  # gemma3: no attention cap; a final cap only where written
        config["attn_logit_softcapping"] = None
        final = meta("final_logit_softcapping", None)
        config["final_logit_softcapping"] = float(final) if final else None
        # global layers keep rope_theta and rope_scaling; local ones their own base, unscaled
        config["rope_local_base_freq"] = float(meta("rope.freq_base_swa", 10000.0))


def _query_pre_attn_scalar(meta: Meta, config: dict) -> float | int:
    """attention.scale (scale = scalar ** -0.5, a float32) where written, as the integer it
    comes from when one gives it back exactly; else llama.cpp's rule for gemma."""
    scale = meta("attention.scale", None)
    if scale is not None:
        scalar = 1.0 / (float(scale) ** 2)
        whole = round(scalar)
        if whole > 0 and np.float32(whole ** -0.5) == np.float32(scale):
            return whole
        return scalar
    if config["num_hidden_layers"] == _BIG_GEMMA_LAYERS[meta.arch]:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _sliding_layers(meta: Meta, layers: int) -> list[bool]:
    """Which layers are windowed: attention.sliding_window_pattern as a per-layer bool array or
    a period n (the last layer of each n is global), else the family's fixed period."""
    pattern = meta("attention.sliding_window_pattern", _GEMMA_PATTERN[meta.arch])
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelLoadError(f"{meta.path}: sliding_window_pattern has {len(pattern)} "
                                 f"entries for {layers} layers")
        return [bool(p) for p in pattern]
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(layers)]


def _phi3(meta: Meta, config: dict) -> None:
    window = int(meta("attention.sliding_window", 0))
    if window:  # the converter writes 0 for "none" (Phi-4)
        config["sliding_window"] = window
    long, short = (meta.tensor(n) for n in _LONGROPE_TENSORS)
    if long is None and short is None:
        if meta("rope.scaling.type", "none") != "none":
            raise ModelLoadError(f"{meta.path}: longrope without its factor tensors")
        return
    if long is None or short is None:
        raise ModelLoadError(f"{meta.path}: longrope needs both {' and '.join(_LONGROPE_TENSORS)}")
    original = int(meta("rope.scaling.original_context_length"))
    scaling: dict[str, Any] = {"rope_type": "longrope", "short_factor": _decimals(short),
                               "long_factor": _decimals(long)}
    stored = meta("rope.scaling.attn_factor", None)
    factor = config["max_position_embeddings"] / original
    implied = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    # transformers recomputes the factor from the context ratio (in double precision); the GGUF
    # holds it as a float32. Only a different value (the converter's yarn formula) is written.
    if stored is not None and np.float32(stored) != np.float32(implied):
        scaling["attention_factor"] = float(stored)
    config["rope_scaling"] = scaling
    config["original_max_position_embeddings"] = original


def _expert_counts(meta: Meta) -> tuple[int, int]:
    """expert_count and expert_used_count; router options llama.cpp's graphs for these families
    do not compute (shared experts, sigmoid scoring, scaled weights) fail the conversion: a GGUF
    that sets them is some other model."""
    experts, used = int(meta("expert_count", 0)), int(meta("expert_used_count", 0))
    if experts < 1 or not 1 <= used <= experts:
        raise ModelLoadError(f"{meta.path}: {used} experts used of {experts}: an MoE model needs "
                             "1 <= expert_used_count <= expert_count")
    if int(meta("expert_shared_count", 0)) or int(meta("expert_shared_feed_forward_length", 0)):
        raise ModelLoadError(f"{meta.path}: shared experts are not supported for {meta.arch}")
    gating = meta("expert_gating_func", None)
    if gating not in (None, 0, 1):  # 0: unset, 1: softmax (gguf's ExpertGatingFuncType)
        raise ModelLoadError(f"{meta.path}: expert_gating_func {gating} is not supported for "
                             f"{meta.arch} (supported: softmax)")
    scale = meta("expert_weights_scale", None)
    if scale not in (None, 0.0, 1.0):
        raise ModelLoadError(f"{meta.path}: expert_weights_scale {scale} is not supported for "
                             f"{meta.arch}")
    return experts, used


def _norm_topk(meta: Meta, fixed: bool) -> bool:
    """llama.cpp's graph for the family renormalizes the top k weights or not, whatever the GGUF
    says; one that says otherwise is refused rather than run differently from llama.cpp."""
    stored = meta("expert_weights_norm", None)
    if stored is not None and bool(stored) != fixed:
        raise ModelLoadError(f"{meta.path}: expert_weights_norm {bool(stored)} is not supported "
                             f"for {meta.arch} (llama.cpp: {fixed})")
    return fixed


def _mixtral(meta: Meta, config: dict) -> None:
    experts, used = _expert_counts(meta)
    _norm_topk(meta, True)  # Mixtral always renormalizes: config.json has no norm_topk_prob
    # llama.cpp's llama graph has no sliding window (a released Mixtral has none either)
    config.update(num_local_experts=experts, num_experts_per_tok=used, sliding_window=None)


def _qwen3moe(meta: Meta, config: dict) -> None:
    experts, used = _expert_counts(meta)
    size = int(meta("expert_feed_forward_length", 0)) or config["intermediate_size"] // used
    # llama.cpp's qwen3moe graph: every layer MoE, no sliding window
    config.update(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=size,
                  norm_topk_prob=_norm_topk(meta, True), decoder_sparse_step=1,
                  mlp_only_layers=[], use_sliding_window=False, sliding_window=None)


def _olmoe(meta: Meta, config: dict) -> None:
    experts, used = _expert_counts(meta)
    # llama.cpp's olmoe graph clips nothing (clip_qkv)
    config.update(num_experts=experts, num_experts_per_tok=used,
                  norm_topk_prob=_norm_topk(meta, False), clip_qkv=None)


def _decimals(values: np.ndarray) -> list[float]:
    """float32 values as the shortest decimals that are the same float32 (1.1, not
    1.100000023841858): what config.json files hold, and what readers turn back into these."""
    return [float(str(v)) for v in values.astype(np.float32)]


ARCHS: dict[str, GgufArch] = {a.name: a for a in (
    GgufArch("llama", "LlamaForCausalLM", "llama", _LLAMA_LAYER, permute_qk=True),
    GgufArch("qwen3", "Qwen3ForCausalLM", "qwen3", {**_LLAMA_LAYER, **_QK_NORMS}),
    GgufArch("gemma2", "Gemma2ForCausalLM", "gemma2", _GEMMA_LAYER, norm_offset=1.0,
             configure=_gemma),
    GgufArch("gemma3", "Gemma3ForCausalLM", "gemma3_text", {**_GEMMA_LAYER, **_QK_NORMS},
             norm_offset=1.0, configure=_gemma),
    GgufArch("phi3", "Phi3ForCausalLM", "phi3", _PHI3_LAYER, configure=_phi3, partial_rotary=True,
             rope_types=("none", "longrope", "su"), config_tensors=_LONGROPE_TENSORS),
    GgufArch("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", {**_MOE_LAYER, **_QK_NORMS},
             configure=_qwen3moe, experts="mlp.experts"),
    GgufArch("olmoe", "OlmoeForCausalLM", "olmoe", {**_MOE_LAYER, **_QK_NORMS},
             configure=_olmoe, experts="mlp.experts"),
)}
# llama.cpp writes Mixtral as a llama with experts (llama.expert_count > 0)
MIXTRAL = GgufArch("llama", "MixtralForCausalLM", "mixtral", _MIXTRAL_LAYER, permute_qk=True,
                   configure=_mixtral, experts="block_sparse_moe.experts",
                   expert_names=_MIXTRAL_EXPERTS)


def build_config(path: Path, reader: Any) -> tuple[dict[str, Any], str | None, GgufArch]:
    """config.json for the GGUF's architecture, its chat template, and the architecture."""
    name = read_field(reader, path, "general.architecture")
    arch = ARCHS.get(name)
    if arch is None:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {name!r} "
                             f"(supported: {', '.join(ARCHS)})")
    meta = Meta(reader, path, name)
    if arch.name == MIXTRAL.name and int(meta("expert_count", 0)) > 0:
        arch = MIXTRAL
    hidden, n_head = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // n_head))
    config: dict[str, Any] = {
        "architectures": [arch.hf_class], "model_type": arch.model_type, "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")), "num_attention_heads": n_head,
        "num_key_value_heads": int(meta("attention.head_count_kv", n_head)), "head_dim": head_dim,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length")),
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }
    _rotary(meta, arch, config)
    arch.configure(meta, config)
    for key in ("bos", "eos", "padding"):
        if (tid := meta.field(f"tokenizer.ggml.{key}_token_id", None)) is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(tid)
    return config, meta.field("tokenizer.chat_template", None), arch


def _rotary(meta: Meta, arch: GgufArch, config: dict) -> None:
    head_dim = config["head_dim"]
    dims = int(meta("rope.dimension_count", head_dim))
    if dims != head_dim:
        if not arch.partial_rotary or not 0 < dims < head_dim:
            raise ModelLoadError(f"{meta.path}: partial rotary embeddings ({dims} of {head_dim} "
                                 f"dims) are not supported for {arch.name}")
        config["partial_rotary_factor"] = partial_rotary_factor(dims, head_dim)
    scaling = meta("rope.scaling.type", "none")
    if scaling not in arch.rope_types:
        raise ModelLoadError(f"{meta.path}: unsupported rope scaling {scaling!r} for {arch.name} "
                             f"(supported: {', '.join(t for t in arch.rope_types if t != 'none')})")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}


def partial_rotary_factor(dims: int, head_dim: int) -> float:
    """dims / head_dim, nudged up where readers' int(head_dim * factor) would give dims - 1."""
    factor = dims / head_dim
    while int(head_dim * factor) < dims:
        factor = math.nextafter(factor, math.inf)
    return factor


def hf_tensor_name(arch: GgufArch, name: str, shape: tuple[int, ...], config: dict) -> str | None:
    """The HF checkpoint name of GGUF tensor `name` (numpy `shape`), None where unknown."""
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if base in TOP_LEVEL:
        return f"{TOP_LEVEL[base]}.{suffix}"
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in arch.per_layer:
        return None
    hf = arch.per_layer[parts[2]]
    if arch.name == "phi3" and parts[2] == "ffn_up" and shape[0] == 2 * config["intermediate_size"]:
        hf = "mlp.gate_up_proj"  # gate's rows, then up's: fused as Phi-3's checkpoints keep it
    return f"model.layers.{int(parts[1])}.{hf}.{suffix}"


def hf_tensors(arch: GgufArch, name: str, w: np.ndarray, config: dict
               ) -> list[tuple[str, np.ndarray]] | None:
    """GGUF tensor `name` (dequantized, numpy's dim order) as the HF checkpoint holds it, None
    where unknown: one tensor, or for an MoE layer's stacked experts [experts, rows, cols] one
    per expert (views into w), which our loader and transformers both read."""
    hf = hf_tensor_name(arch, name, w.shape, config)
    if hf is not None:
        return [(hf, undo_layout(arch, name, w, config))]
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if not arch.experts or len(parts) != 3 or parts[0] != "blk" or w.ndim != 3:
        return None
    proj = _EXPERT_PARTS.get(parts[2])
    if proj is None:
        return None
    proj = dict(arch.expert_names).get(proj, proj)
    prefix = f"model.layers.{int(parts[1])}.{arch.experts}"
    return [(f"{prefix}.{e}.{proj}.{suffix}", w[e]) for e in range(w.shape[0])]


def undo_layout(arch: GgufArch, name: str, w: np.ndarray, config: dict) -> np.ndarray:
    """A dequantized GGUF tensor as the HF checkpoint holds it."""
    part = name.rpartition(".")[0].rpartition(".")[2]
    if arch.permute_qk and part in ("attn_q", "attn_k"):
        return unpermute(w, config["num_attention_heads"] if part == "attn_q"
                         else config["num_key_value_heads"])
    if arch.norm_offset and part.endswith("norm"):
        return undo_norm_offset(w, arch.norm_offset)
    return w


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf permutes q/k rows per head from HF's half-split rotary
    # layout to GGML's interleaved-pair layout; invert it: (h, 2, d/2) <- (h, d/2, 2).
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def undo_norm_offset(g: np.ndarray, offset: float) -> np.ndarray:
    """w from the stored g = float32(w + offset). The original w is lost where that sum
    rounded, but what a model computes with it is not: float32(float32(g - 1) + 1) == g for
    every g >= 0.5 (g - 1 is exact there, Sterbenz), so our loader's 1 + w and transformers'
    are llama.cpp's g bit for bit. Below 0.5 (w < -0.5) g - 1 rounds to w's grid: the model's
    1 + w is then within 2**-25 of g for 0 < g < 0.5, 2**-22 for -4 < g <= 0."""
    return (np.asarray(g, dtype=np.float32) - np.float32(offset)).astype(np.float32)
