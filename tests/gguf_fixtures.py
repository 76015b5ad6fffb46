"""Tiny HF checkpoints (tests/tiny_models.py) written as GGUF files the way llama.cpp's
convert_hf_to_gguf.py writes them: its tensor names (taken from gguf-py's own TensorNameMap, not
from the importer under test), its layouts (Gemma's norms as w + 1; Phi-3's qkv_proj and
gate_up_proj fused as they are, its longrope factors as tensors) and its metadata keys.

Two keys the converter does not write for Gemma are added, because the tiny checkpoints'
values fit none of the rules llama.cpp's loader falls back on: attention.scale
(query_pre_attn_scalar 24, where llama.cpp would take head_dim 32) and, for gemma3,
attention.sliding_window_pattern (a window on every other layer, where llama.cpp assumes five
of every six).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from tests.tiny_models import gguf_round_trip

GGUF_ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
BLOCK = 32


def quantized_kind(name: str, shape: tuple[int, ...]) -> str | None:
    """The quantized variant stores what the default model quantizes: decoder linears as Q4_1,
    an untied lm_head as Q8_0. Rows that are not whole blocks stay float32 (llama.cpp's
    quantizer falls back the same way: Qwen3's tiny o_proj, 144 wide)."""
    if shape[-1] % BLOCK:
        return None
    if ".layers." in name and name.endswith("proj.weight"):
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
    for name, t in tensors.items():
        if name == "lm_head.weight" and arch == "gemma2":
            continue  # the converter drops it: Gemma 2's head is the embedding
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1  # the converter folds Gemma's (1 + w) into the weight
        _add_tensor(w, names.get_name(name, try_suffixes=(".weight",)), name, t, quantize)
    if arch == "phi3":
        _longrope(w, cfg)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


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
    rope = cfg.get("rope_parameters") or {}
    if arch == "phi3":
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        return
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
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
