"""Embeddings: how a prompt's final hidden states (after the model's last norm, transformers'
`last_hidden_state`) become one vector.

The checkpoint says how, as sentence-transformers writes it: `modules.json` naming a Pooling
module (its `config.json`: `pooling_mode_lasttoken`, `pooling_mode_mean_tokens` or
`pooling_mode_cls_token`) and, optionally, a Normalize module. Without them: the last token,
L2-normalized (decoder embedding models: Qwen3-Embedding, gte-Qwen2, e5-mistral). The engine's
`pooling` setting overrides the method. `dimensions` d keeps the first d values (Matryoshka),
renormalized where the model normalizes, as vLLM does.

An embedding request is a prompt that is computed and never sampled: its chunks go through the
same steps as generation, and each chunk hands over only the rows pooling needs (the first row
for CLS, the last for last-token, all of them for mean). Mean and CLS need every prompt token's
hidden state, so such a prompt does not take cached prefix blocks (their tokens would not be
computed); last-token pooling does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

METHODS = ("last", "mean", "cls")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolingConfig:
    method: str = "last"
    normalize: bool = True

    @staticmethod
    def from_dir(model_dir: Path, override: str | None = None) -> "PoolingConfig":
        """The checkpoint's pooling (sentence-transformers files), else last + normalize;
        `override` replaces the method. Raises ValueError for what cannot be served."""
        method, normalize = "last", True
        modules_file = Path(model_dir) / "modules.json"
        if modules_file.is_file():
            modules = json.loads(modules_file.read_text())
            kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
            normalize = "Normalize" in kinds
            if "Pooling" in kinds:
                method = _st_method(Path(model_dir) / kinds["Pooling"].get("path", ""))
        if override:
            if override not in METHODS:
                raise ValueError(f"pooling: must be one of {', '.join(METHODS)}, got {override!r}")
            method = override
        return PoolingConfig(method, normalize)


def _st_method(pooling_dir: Path) -> str:
    cfg = json.loads((pooling_dir / "config.json").read_text())
    on = [m for key, m in _ST_MODES.items() if cfg.get(key)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v
              and k not in _ST_MODES]
    if len(on) != 1 or others:
        raise ValueError(f"{pooling_dir / 'config.json'}: pooling modes {on + others} are not "
                         f"supported (one of {', '.join(sorted(_ST_MODES))})")
    return on[0]


@dataclass(eq=False)
class EmbeddingState:
    """One embedding request's pooling: what it adds up as its chunks are computed."""
    config: PoolingConfig
    dimensions: int | None = None
    next_position: int = 0  # rows of earlier positions were taken (a recompute skips them)
    total: torch.Tensor | None = None  # float64 sum (mean), or the row (cls, last)
    count: int = 0

    @property
    def whole_prompt(self) -> bool:
        """Every prompt token's hidden state is read: no cached prefix may stand in for them."""
        return self.config.method != "last"

    def rows(self, start: int, n: int, num_tokens: int) -> tuple[int, int]:
        """Of a chunk computing positions [start, start + n) of a num_tokens prompt: the first
        position and number of rows pooling takes."""
        method = self.config.method
        if method == "mean":
            return start, n
        if method == "cls":
            return (0, 1) if start == 0 else (start, 0)
        return (num_tokens - 1, 1) if start + n == num_tokens else (start, 0)

    def add(self, first_position: int, hidden: torch.Tensor) -> None:
        """Hidden states [k, H] of positions first_position.. (rows already taken skipped)."""
        skip = max(0, self.next_position - first_position)
        hidden = hidden[skip:].to(torch.float64)
        if hidden.shape[0] == 0:
            return
        self.next_position = first_position + skip + hidden.shape[0]
        if self.config.method == "mean":
            s = hidden.sum(0)
            self.total = s if self.total is None else self.total + s
        else:
            self.total = hidden[-1]
        self.count += hidden.shape[0]

    def result(self) -> list[float]:
        v = self.total / self.count if self.config.method == "mean" else self.total
        if self.dimensions is not None:
            v = v[:self.dimensions]
        if self.config.normalize:
            v = v / v.norm().clamp_min(1e-12)
        return v.to(torch.float32).tolist()


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not (
            1 <= dimensions <= hidden_size):
        raise ValueError(f"dimensions: must be an integer in [1, {hidden_size}] (the model's "
                         f"hidden size), got {dimensions!r}")
