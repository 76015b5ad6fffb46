"""Tiny HF checkpoints (tests/tiny_models.py) written as GGUF files the way llama.cpp's
convert_hf_to_gguf.py writes them: its tensor names (taken from gguf-py's own TensorNameMap, not
from the importer under test), its layouts (Gemma's norms as w + 1; Phi-3's qkv_proj and
gate_up_proj fused as they are, its longrope factors as tensors; llama's q/k rows permuted, Mixtral
included; an MoE layer's experts stacked per projection, [experts, rows, cols]) and its metadata
keys.

The tiny MoE checkpoints are first made into what a llama.cpp GGUF can hold (make_checkpoint):
Mixtral without its sliding window (llama.cpp's llama graph has none, nor does a released
Mixtral), Qwen3-MoE with every layer MoE (llama.cpp's qwen3moe has no dense layers: its
converter cannot even name their tensors).

Two keys the converter does not write for Gemma are added, because the tiny checkpoints'
values fit none of the rules llama.cpp's loader falls back on: attention.scale
(query_pre_attn_scalar 24, where llama.cpp would take head_dim 32) and, for gemma3,
attention.sliding_window_pattern (a window on every other layer, where llama.cpp assumes five
of every six).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch

from tests.tiny_models import gguf_round_trip, make_tiny_checkpoint

GGUF_ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",
             "mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
BLOCK = 32
# one expert's projection in a checkpoint: (layer, its experts' prefix, expert, projection)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)"
                     r"\.weight")
# the stacked name the converter maps each projection's experts under (LlamaModel for Mixtral,
# Qwen2MoeModel / OlmoeModel for the others)
_STACKED = {"block_sparse_moe": "layers.{layer}.feed_forward.experts.{proj}.weight",
            "mlp": "model.layers.{layer}.mlp.experts.{proj}.weight"}


def make_checkpoint(arch: str, out_dir: Path) -> Path:
    """make_tiny_checkpoint's checkpoint, as a llama.cpp GGUF can hold it (top of the file)."""
    out_dir = make_tiny_checkpoint(arch, out_dir)
    if arch == "mixtral":
        _edit_config(out_dir, sliding_window=None)
    elif arch == "qwen3_moe":
        _all_layers_moe(out_dir)
    return out_dir


def _edit_config(model_dir: Path, **fields) -> dict:
    path = Path(model_dir) / "config.json"
    cfg = {**json.loads(path.read_text()), **fields}
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg


def _all_layers_moe(model_dir: Path) -> None:
    """Qwen3-MoE's dense layers (decoder_sparse_step, mlp_only_layers) made MoE: a router and
    experts drawn as make_tiny_checkpoint draws weights, in place of the dense MLP."""
    from safetensors.torch import load_file, save_file

    cfg = _edit_config(model_dir, decoder_sparse_step=1, mlp_only_layers=[])
    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(path)
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    hidden, size = cfg["hidden_size"], cfg["moe_intermediate_size"]
    gen = torch.Generator().manual_seed(1)
    for layer in range(cfg["num_hidden_layers"]):
        mlp = f"model.layers.{layer}.mlp"
        if f"{mlp}.gate.weight" in tensors:
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del tensors[f"{mlp}.{proj}.weight"]
        tensors[f"{mlp}.gate.weight"] = torch.randn(experts, hidden, generator=gen) * 0.15
        for e in range(experts):
            for proj, shape in (("gate_proj", (size, hidden)), ("up_proj", (size, hidden)),
                                ("down_proj", (hidden, size))):
                w = torch.randn(*shape, generator=gen) * 0.15
                tensors[f"{mlp}.experts.{e}.{proj}.weight"] = w
    save_file(tensors, path, metadata={"format": "pt"})


def quantized_kind(name: str, shape: tuple[int, ...]) -> str | None:
    """The quantized variant stores what the default model quantizes: decoder linears (experts
    included, Mixtral's w1 / w2 / w3) as Q4_1, an untied lm_head as Q8_0. Rows that are not
    whole blocks stay float32 (llama.cpp's quantizer falls back the same way: Qwen3's tiny
    o_proj, 144 wide, Qwen3-MoE's expert down_proj, 72 wide); so do MoE routers (the converter
    keeps ffn_gate_inp float32)."""
    if shape[-1] % BLOCK:
        return None
    if ".layers." in name and name.endswith(("proj.weight", ".w1.weight", ".w2.weight",
                                              ".w3.weight")):
        return "Q4_1"
    return "Q8_0" if name == "lm_head.weight" else None


def round_trip_checkpoint(model_dir: Path) -> None:
    """The checkpoint as the quantized GGUF holds it: each quantized_kind tensor quantized and
    dequantized again (float32), so both directories carry the same weights."""
    from safetensors.torch import load_file, save_file

    for f in Path(model_dir).glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if (kind := quantized_kind(name, tuple(t.shape))) is not None:
                tensors[name] = gguf_round_trip(t, kind)
        save_file(tensors, f, metadata={"format": "pt"})


def write_gguf(model_dir: Path, path: Path, quantize: bool = False) -> Path:
    """`model_dir`'s checkpoint as llama.cpp's converter would write it, float32 tensors unless
    `quantize` (then quantized_kind's)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, cfg)
    _tokenizer(w, cfg)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    tensors = load_file(Path(model_dir) / "model.safetensors")
    experts: dict[tuple[int, str, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name == "lm_head.weight" and arch == "gemma2":
            continue  # the converter drops it: Gemma 2's head is the embedding
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1  # the converter folds Gemma's (1 + w) into the weight
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            t = _permute(t, heads)
        if (m := _EXPERT.fullmatch(name)) is not None:
            experts.setdefault((int(m[1]), m[2], m[4]), {})[int(m[3])] = t
            continue
        _add_tensor(w, names.get_name(name, try_suffixes=(".weight",)), name, t, quantize)
    for (layer, prefix, proj), by_expert in experts.items():
        # the converter's merge: expert 0's rows first (torch.stack), quantized as one tensor
        stacked = torch.stack([by_expert[e] for e in range(len(by_expert))])
        merged = _STACKED[prefix].format(layer=layer, proj=proj)
        one = f"model.layers.{layer}.{prefix}.experts.0.{proj}.weight"  # its quantized_kind
        _add_tensor(w, names.get_name(merged, try_suffixes=(".weight",)), one, stacked, quantize)
    if arch == "phi3":
        _longrope(w, cfg)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _permute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """LlamaModel.permute: each head's rows from HF's half-split rotary layout to GGML's
    interleaved pairs."""
    rows = t.shape[0] // heads // 2
    return t.reshape(heads, 2, rows, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _add_tensor(w, gguf_name: str | None, name: str, t: torch.Tensor, quantize: bool) -> None:
    import gguf
    from gguf.quants import quantize as quantize_blocks

    assert gguf_name is not None, f"no llama.cpp name for {name}"
    a = t.detach().float().contiguous().numpy()
    kind = quantized_kind(name, a.shape) if quantize else None
    if kind is None:
        w.add_tensor(gguf_name, a)
    else:
        qtype = gguf.GGMLQuantizationType[kind]
        w.add_tensor(gguf_name, quantize_blocks(a, qtype), raw_dtype=qtype)


def _metadata(w, arch: str, cfg: dict) -> None:
    import gguf

    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if experts := cfg.get("num_local_experts") or cfg.get("num_experts"):  # TextModel's keys
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3moe":  # Qwen2MoeModel's
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    rope = cfg.get("rope_parameters") or {}
    if arch == "phi3":
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        return
    if cfg.get("head_dim"):  # only where config.json has one (Mixtral's is null)
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "llama":  # LlamaModel's
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg.get("head_dim")
                                   or cfg["hidden_size"] // cfg["num_attention_heads"])
    glob = rope.get("full_attention", rope)
    if arch != "gemma2":  # Gemma 2's converter writes no rope base (llama.cpp: 10000)
        w.add_rope_freq_base(glob["rope_theta"])
    if glob.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(glob["factor"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if arch in ("gemma2", "gemma3"):
        _gemma_metadata(w, arch, cfg)


def _gemma_metadata(w, arch: str, cfg: dict) -> None:
    w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    else:
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    w.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)


def _longrope(w, cfg: dict) -> None:
    """Phi-3's longrope as the converter writes it: the factors as tensors, the attention factor
    it computes from the context ratio as metadata."""
    rope = cfg["rope_parameters"]
    original = cfg["original_max_position_embeddings"]
    scale = cfg["max_position_embeddings"] / original
    w.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def _tokenizer(w, cfg: dict) -> None:
    """A sentencepiece-style vocabulary of the checkpoint's size: unk, bos, eos, 256 byte
    pieces, words. Enough for transformers to build a tokenizer from the GGUF."""
    n = cfg["vocab_size"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"\u2581w{i}" for i in range(n - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (n - 259))  # unknown, control, byte, normal
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("pad_token_id") is not None:
        w.add_pad_token_id(cfg["pad_token_id"])


def write_metadata_gguf(path: Path, arch: str, layers: int,
                        tensors: dict[str, np.ndarray] | None = None, **extra) -> Path:
    """A GGUF with a shape's metadata (8 heads of 64 over 512 wide, 4 KV heads), `tensors` and
    no vocabulary, plus `extra` keys by GGUFWriter method name (sliding_window=8 calls
    add_sliding_window(8)): enough for the importer's config, not for a model."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(64 * 8)
    w.add_feed_forward_length(128)
    w.add_head_count(8)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    for method, value in extra.items():
        getattr(w, f"add_{method}")(value)
    for name, t in (tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
