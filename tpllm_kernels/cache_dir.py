"""The project's cache directory: one convention for every layer (converted checkpoints, built
C++ kernels, the TP shared key, Triton backend shims). It lives in tpllm_kernels/, the bottom
layer, so that every package may import it; it imports nothing of the project."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$TPLLM_CACHE_DIR, else $XDG_CACHE_HOME/tp-llm, else ~/.cache/tp-llm."""
    if os.environ.get("TPLLM_CACHE_DIR"):
        return Path(os.environ["TPLLM_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tp-llm"
