"""Rotary position embedding tables, computed once at load for every position the engine serves."""
from __future__ import annotations

import math

import torch

from backend.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    factor = float(sc["factor"])
    if kind == "linear":
        return inv / factor
    # llama3: long wavelengths are slowed by `factor`, short kept, the band between interpolated.
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_len = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryTables:
    """cos/sin of shape [max_positions, head_dim] (halves duplicated, HF/neox layout)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        # computed on CPU whatever the device, so every device serves the same table values
        pos = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(pos, inverse_frequencies(cfg).cpu())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype).to(device)
        self.sin = emb.sin().to(dtype).to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)
