"""Where a model's files come from: the checkpoint directory (the embedded default when none is
given) and its tokenizer, if it ships one."""
from __future__ import annotations

import logging
from pathlib import Path

from backend.model.errors import ModelLoadError

log = logging.getLogger("backend.engine")


def resolve_model_dir(model: str | None) -> Path:
    if model is None or model == "":
        from backend.model.gguf_import import default_model_dir
        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"{path}: model directory not found")
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None when it ships none (then prompts are token ids)."""
    from transformers import AutoTokenizer
    if not any((model_dir / f).exists() for f in TOKENIZER_FILES):
        log.warning("%s has no tokenizer: prompts must be token ids, outputs carry no text",
                    model_dir)
        return None
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:
        raise ModelLoadError(f"{model_dir}: cannot load the tokenizer ({e})") from None
