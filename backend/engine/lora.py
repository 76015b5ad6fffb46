"""The engine's LoRA adapters: the settings checked, the adapters named in lora_modules loaded
(all of them, at start) and attached to the model, a request's lora_name resolved to its
adapter id, and the step inputs of warmup's LoRA steps.

max_loras caps the distinct adapters one step runs (the scheduler admits no request of another
adapter while that many are running); max_cpu_loras caps the adapters held in memory, which are
all of lora_modules (loaded at start, none swapped in later), so there may be no more of them.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from backend.engine.sampling.sampling_params import SamplingParams
from backend.engine.sequence import Sequence
from backend.engine.step_inputs import StepInputs
from backend.model.config import ModelConfig
from backend.model.lora_adapter import load_adapters
from backend.model.lora_layers import attach_adapters


def validate_lora_settings(enable_lora: bool, max_loras: int, max_lora_rank: int,
                           max_cpu_loras: int | None, lora_modules: dict | None) -> None:
    """Raises ValueError naming the field (EngineConfig.validate)."""
    if not isinstance(enable_lora, bool):
        raise ValueError(f"enable_lora: must be a boolean, got {enable_lora!r}")
    for name, v in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank),
                    ("max_cpu_loras", max_cpu_loras)):
        if v is None and name == "max_cpu_loras":
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise ValueError(f"max_cpu_loras: must be >= max_loras ({max_loras}), got {max_cpu_loras}")
    if lora_modules is None:
        return
    if not isinstance(lora_modules, dict) or not all(
            isinstance(k, str) and k.strip() and isinstance(v, str) and v.strip()
            for k, v in lora_modules.items()):
        raise ValueError("lora_modules: must map adapter names (non-empty strings) to adapter "
                         f"directories, got {lora_modules!r}")
    if lora_modules and not enable_lora:
        raise ValueError("lora_modules: adapters given but enable_lora is false")
    if max_cpu_loras is not None and len(lora_modules) > max_cpu_loras:
        raise ValueError(f"lora_modules: {len(lora_modules)} adapters, more than max_cpu_loras "
                         f"({max_cpu_loras}); every adapter is held in memory from the start")


class LoraRegistry:
    """Adapter names -> ids (1, 2, ... in lora_modules' order; the same on every TP rank)."""

    def __init__(self, enabled: bool, names: list[str], max_loras: int):
        self.enabled = enabled
        self.ids = {name: i for i, name in enumerate(names, 1)}
        self.max_loras = max_loras

    @classmethod
    def from_config(cls, config) -> "LoraRegistry":
        return cls(config.enable_lora, list(config.lora_modules or {}), config.max_loras)

    def attach(self, model, modules: dict[str, str] | None, cfg: ModelConfig,
               max_rank: int) -> None:
        """Load every adapter (errors name it) and give the model this rank's shards."""
        model.lora_rows = attach_adapters(model, load_adapters(modules or {}, cfg, max_rank))

    def check(self, params: SamplingParams) -> None:
        """A request's lora_name must name a configured adapter (ValueError naming it)."""
        name = params.lora_name
        if name is None:
            return
        if not self.enabled:
            raise ValueError(f"lora_name: {name!r} requested but LoRA is not enabled for this "
                             "model (enable_lora)")
        if name not in self.ids:
            known = ", ".join(repr(n) for n in self.ids) or "none"
            raise ValueError(f"lora_name: unknown LoRA adapter {name!r} (configured: {known})")

    def bind(self, seq: Sequence) -> None:
        """Tag a new sequence with its adapter's id (after check)."""
        name = seq.params.lora_name
        seq.lora_id = self.ids[name] if name is not None else 0

    def warmup_steps(self, steps: list[StepInputs]) -> list[StepInputs]:
        """Each step again with its rows spread over the adapters a step may hold (all real
        rows adapter rows: the LoRA shapes of the step kinds and sizes warmup runs)."""
        if not self.ids:
            return []
        ids = np.arange(min(self.max_loras, len(self.ids))) + 1
        return [replace(s, lora_ids=np.resize(ids, s.num_tokens).astype(np.int64))
                for s in steps]
