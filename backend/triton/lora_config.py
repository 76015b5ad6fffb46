"""multi_lora.json (the vLLM backend's convention): in the model's version folder, a JSON object
mapping each LoRA adapter's name to its directory; a relative directory is relative to that
folder. Read at load when enable_lora is set; every error names the file (and the adapter)."""
from __future__ import annotations

import json
from pathlib import Path

FILE = "multi_lora.json"


def read_multi_lora(version_dir: Path) -> dict[str, str]:
    """{adapter name: absolute directory}; {} without the file. Raises ValueError."""
    path = Path(version_dir) / FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a JSON object mapping adapter names to directories")
    out = {}
    for name, where in raw.items():
        if not name.strip() or not isinstance(where, str) or not where.strip():
            raise ValueError(f"{path}: adapter {name!r}: its directory must be a non-empty "
                             f"string, got {where!r}")
        d = Path(where).expanduser()
        out[name] = str(d if d.is_absolute() else (Path(version_dir) / d).resolve())
    return out


def lora_modules(engine_kwargs: dict, model_repository: str, version: str) -> dict:
    """The lora_modules setting for the engine: multi_lora.json's adapters when enable_lora."""
    if not engine_kwargs.get("enable_lora"):
        return {}
    modules = read_multi_lora(Path(model_repository) / str(version or "1"))
    return {"lora_modules": modules} if modules else {}
