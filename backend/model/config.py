"""The decoder's shape, read from a checkpoint's config.json.

Parsed from the raw JSON rather than through transformers' config classes: their field names
move between releases (rope_theta vs rope_parameters), the JSON on disk does not.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from backend.model.errors import ModelLoadError
from backend.parallel.partition import HeadPartition

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

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
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r}; only 'silu' is supported")
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        theta = raw.get("rope_theta") or rope.get("rope_theta") or 10000.0
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "linear"):
            raise ModelLoadError(f"unsupported rope_scaling {scaling!r}; supported: llama3, linear")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            window = None
        attn_bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attn_bias,
            o_bias=model_type != "qwen2" and attn_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=int(window) if window else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def kv_bytes_per_token(self, dtype_bytes: int, tp_size: int = 1) -> int:
        """Bytes of K and V cache one token takes on one rank (all layers)."""
        kv_local = max(HeadPartition.build(self.num_heads, self.num_kv_heads, r, tp_size).num_kv
                       for r in range(tp_size))
        return 2 * self.num_layers * kv_local * self.head_dim * dtype_bytes
