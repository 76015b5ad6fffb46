"""Rotary position embedding tables, computed once at load for every position the engine serves.

Every kernel rotates a head's dims in the neox layout (dim i with dim i + head_dim / 2) over the
whole head. Partial rotary (Phi-4-mini turns 3/4 of each head) fits that without a kernel of
its own: the q and k projections' rows are permuted within each head at load
(head_permutation) so that the turned dims' pairs sit i and i + head_dim / 2 apart, and the
dims left alone get cos 1 and sin 0, which leave them exactly as they were. Attention reads q
and k only through their dot product, which the same permutation of both leaves unchanged.
"""
from __future__ import annotations

import torch

from backend.model.config import ModelConfig
from backend.model.rope_scaling import rope_frequencies, rope_tables


def head_permutation(cfg: ModelConfig) -> torch.Tensor | None:
    """Where each dim of a q/k head comes from in the checkpoint's layout, for partial rotary;
    None when rotary turns the whole head."""
    d, r = cfg.head_dim, cfg.rotary_dim
    if r == d:
        return None
    half, rest = r // 2, (d - r) // 2
    order = (list(range(half)) + list(range(r, r + rest)) + list(range(half, r))
             + list(range(r + rest, d)))
    return torch.tensor(order)


def permute_head_rows(rows: torch.Tensor, perm: torch.Tensor, head_dim: int) -> torch.Tensor:
    """rows [heads * head_dim, ...] (a q or k projection's weight, bias or LoRA B) with each
    head's rows in head_permutation's order."""
    heads = rows.view(-1, head_dim, *rows.shape[1:])
    return heads.index_select(1, perm.to(rows.device)).view(rows.shape)


def _tables(cfg: ModelConfig, theta: float, scaling: dict | None, max_positions: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = rope_frequencies(cfg.rotary_dim, theta, scaling, cfg.max_position_embeddings,
                             cfg.original_max_position_embeddings)
    cos, sin = rope_tables(freqs, max_positions, torch.float32)
    d, r = cfg.head_dim, cfg.rotary_dim
    if r < d:  # the dims rotary leaves alone: cos 1, sin 0 (head_permutation's layout)
        pad = (d - r) // 2
        c, s = cos[:, :r // 2], sin[:, :r // 2]
        c = torch.cat((c, torch.ones(max_positions, pad)), dim=-1)
        s = torch.cat((s, torch.zeros(max_positions, pad)), dim=-1)
        cos, sin = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
    return cos, sin


class RotaryTables:
    """cos/sin of shape [max_positions, head_dim] (halves duplicated, HF/neox layout); `local`:
    the windowed layers' own pair where they have their own rope (Gemma 3), else None."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        # computed on CPU whatever the device, so every device serves the same table values
        cos, sin = _tables(cfg, cfg.rope_theta, cfg.rope_scaling, max_positions)
        self.cos, self.sin = cos.to(dtype).to(device), sin.to(dtype).to(device)
        self.local: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.local_rope_theta is not None and any(cfg.layer_windows):
            lc, ls = _tables(cfg, cfg.local_rope_theta, cfg.local_rope_scaling, max_positions)
            self.local = (lc.to(dtype).to(device), ls.to(dtype).to(device))

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)

    def lookup_all(self, positions: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """AttentionMetadata's rope fields for these positions: cos, sin and, where windowed
        layers have their own, local_cos and local_sin."""
        cos, sin = self.lookup(positions)
        if self.local is None:
            return {"cos": cos, "sin": sin}
        return {"cos": cos, "sin": sin, "local_cos": self.local[0].index_select(0, positions),
                "local_sin": self.local[1].index_select(0, positions)}
