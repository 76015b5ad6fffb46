"""Reading and checking a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)
against the model it is meant for. Every error is a LoraAdapterError whose message names the
adapter, so an operator can tell which of several adapters is wrong.

What is served: LoRA on the decoder layers' q/k/v/o and gate/up/down projections, scaled by
lora_alpha / r (or lora_alpha / sqrt(r) with use_rslora); Phi-3's fused qkv_proj and
gate_up_proj adapters are split into those at load (their A is shared, B splits by rows). PEFT features that change the math
beyond that (DoRA, LoRA biases, per-module rank or alpha patterns, fan_in_fan_out, trained
copies of other modules) are refused at load rather than served wrong, and so is every adapter
of a model with mixture-of-experts layers (backend/model/moe.py: its experts take no adapters,
and the adapters' slots are attached to every layer's dense MLP).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from backend.model.config import ModelConfig
from backend.model.errors import ModelLoadError
from backend.model.rotary import head_permutation, permute_head_rows

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module name -> where it sits in a decoder layer
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# a fused checkpoint's modules (Phi-3) -> the modules their B's rows split into, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# every module an adapter may name -> where it sits in a decoder layer
_PARENT = {**TARGETS, **{m: TARGETS[parts[0]] for m, parts in FUSED.items()}}
_KEY = re.compile(r"(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(?:model\.)?"
                  r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight")


class LoraAdapterError(ModelLoadError):
    """An adapter that cannot be served; the message names it."""


@dataclass
class LoraAdapter:
    """One adapter's full-size (unsharded) float32 matrices: (layer, module) -> (A [r, in],
    B [out, r]); module is PEFT's name (q_proj, ...). delta(x) = scale * x @ A^T @ B^T."""
    name: str
    path: Path
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a decoder-layer projection of the full model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]


def load_adapter(name: str, path: str | Path, cfg: ModelConfig,
                 max_rank: int) -> LoraAdapter:
    """The adapter in directory `path`, checked against `cfg` (architecture and shapes) and
    max_rank. Raises LoraAdapterError naming `name`."""
    def fail(msg: str) -> LoraAdapterError:
        return LoraAdapterError(f"LoRA adapter {name!r} ({path}): {msg}")

    path = Path(path)
    if cfg.moe_layers:
        raise fail(f"LoRA adapters are not served on mixture-of-experts models ({cfg.model_type} "
                   f"has experts in {len(cfg.moe_layers)} of its {cfg.num_layers} layers)")
    if not path.is_dir():
        raise fail("no such directory")
    conf = _read_config(path, fail)
    rank, scale = _rank_and_scale(conf, max_rank, fail)
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        hint = " (only adapter_model.bin found: convert it to safetensors)" if (
            path / "adapter_model.bin").exists() else ""
        raise fail(f"{WEIGHTS_FILE} not found{hint}")
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():
                m = _KEY.fullmatch(key)
                if m is None or _PARENT.get(m.group(3)) != m.group(2):
                    raise fail(f"unsupported tensor {key!r}: only LoRA on the decoder layers' "
                               f"{'/'.join(_PARENT)} is served")
                halves[(int(m.group(1)), m.group(3), m.group(4))] = f.get_tensor(key).float()
    except LoraAdapterError:
        raise
    except Exception as e:  # safetensors' own error types for corrupt files
        raise fail(f"unreadable {WEIGHTS_FILE} ({e})") from None
    weights = {}
    for (layer, module, half), t in sorted(halves.items()):
        if half == "B":
            continue
        b = halves.get((layer, module, "B"))
        where = f"layers.{layer}.{module}"
        if b is None:
            raise fail(f"{where}: lora_A without lora_B")
        if layer >= cfg.num_layers:
            raise fail(f"{where}: the model has {cfg.num_layers} layers (an adapter for another "
                       f"model?)")
        parts = FUSED.get(module, (module,))
        d_in = module_shape(cfg, parts[0])[0]
        d_out = sum(module_shape(cfg, p)[1] for p in parts)
        for label, got, want in (("lora_A", t, [rank, d_in]), ("lora_B", b, [d_out, rank])):
            if list(got.shape) != want:
                raise fail(f"{where}.{label} has shape {list(got.shape)}, this "
                           f"{cfg.model_type} model needs {want} (r={rank}; an adapter for "
                           f"another model?)")
        for part, rows in zip(parts, b.split([module_shape(cfg, p)[1] for p in parts])):
            if (layer, part) in weights:
                raise fail(f"layers.{layer}: {part} given twice (fused and apart)")
            weights[(layer, part)] = (t.contiguous(), _kernel_rows(cfg, part, rows))
    unpaired = {(l, m) for l, m, h in halves if h == "B"} - {(l, m) for l, m, h in halves
                                                               if h == "A"}
    if unpaired:
        layer, module = min(unpaired)
        raise fail(f"layers.{layer}.{module}: lora_B without lora_A")
    if not weights:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    return LoraAdapter(name, path, rank, scale, weights)


def _kernel_rows(cfg: ModelConfig, module: str, b: torch.Tensor) -> torch.Tensor:
    """B's output rows in the order the model's weight rows are in: with partial rotary, each
    q and k head's as rotary.head_permutation put the weights' (loader.to_kernel_layout)."""
    perm = head_permutation(cfg)
    if perm is None or module not in ("q_proj", "k_proj"):
        return b.contiguous()
    return permute_head_rows(b.contiguous(), perm, cfg.head_dim)


def _read_config(path: Path, fail) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise fail(f"{CONFIG_FILE} not found")
    try:
        conf = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise fail(f"unreadable {CONFIG_FILE} ({e})") from None
    if not isinstance(conf, dict):
        raise fail(f"{CONFIG_FILE} must hold a JSON object")
    if conf.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {conf['peft_type']!r}: only LORA adapters are served")
    refused = [("use_dora", conf.get("use_dora")), ("fan_in_fan_out", conf.get("fan_in_fan_out")),
               ("modules_to_save", conf.get("modules_to_save")),
               ("rank_pattern", conf.get("rank_pattern")),
               ("alpha_pattern", conf.get("alpha_pattern"))]
    for key, value in refused:
        if value:
            raise fail(f"{key}={value!r} is not supported")
    if conf.get("bias", "none") != "none":
        raise fail(f"bias={conf['bias']!r} is not supported (only 'none')")
    targets = conf.get("target_modules")
    if isinstance(targets, (list, tuple)):
        other = sorted(str(t) for t in targets if str(t).rsplit(".", 1)[-1] not in _PARENT)
        if other:
            raise fail(f"target_modules {other} not supported: only {', '.join(_PARENT)}")
    return conf


def _rank_and_scale(conf: dict, max_rank: int, fail) -> tuple[int, float]:
    r, alpha = conf.get("r"), conf.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise fail(f"r must be an integer >= 1, got {r!r}")
    if r > max_rank:
        raise fail(f"rank r={r} exceeds max_lora_rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise fail(f"lora_alpha must be a number, got {alpha!r}")
    rslora = conf.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise fail(f"use_rslora must be a boolean, got {rslora!r}")
    return r, alpha / (math.sqrt(r) if rslora else r)


def load_adapters(modules: dict[str, str], cfg: ModelConfig,
                  max_rank: int) -> list[LoraAdapter]:
    """Every adapter of `modules` (name -> directory), in its order (adapter ids 1, 2, ...)."""
    return [load_adapter(name, path, cfg, max_rank) for name, path in modules.items()]
