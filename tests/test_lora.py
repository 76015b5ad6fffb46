"""Multi-LoRA: greedy tokens equal transformers' with each adapter merged into the weights, for
rows of several adapters (and none) in one batch, prefill chunks and decodes together; a row in
a mixed batch equals the same request alone; adapter errors name the adapter."""
from __future__ import annotations

import json

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.kv_manager import KVCacheManager
from backend.engine.speculation.speculator import StepCost
from backend.engine.sequence import Sequence
from backend.model.config import ModelConfig
from backend.model.lora_adapter import LoraAdapterError, load_adapter
from tests.lora_adapters import greedy, make_adapter, merged_model
from tests.tiny_models import ARCHS, make_tiny_checkpoint

pytest.importorskip("peft")

TOKENS = 10


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 21, 40)]


def _reference(model_dir, adapters: dict, prompts) -> dict:
    """(adapter name or None, prompt index) -> transformers' greedy tokens, adapter merged."""
    out = {}
    for name, path in [(None, None), *adapters.items()]:
        ref = merged_model(model_dir, path)
        for i, p in enumerate(prompts):
            out[(name, i)] = greedy(ref, p, TOKENS)
    return out


def _params(name: str | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, lora_name=name, **kw)


def _cold_events(llm: LLM) -> int:
    return sum(llm.stats["cold_path"].values())


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_merged_transformers(arch, tmp_path):
    model = make_tiny_checkpoint(arch, tmp_path / "model", bias=arch == "llama")
    adapters = {
        "all": make_adapter(model, tmp_path / "all", r=8, alpha=16, seed=1),
        "qv_down": make_adapter(model, tmp_path / "qv", r=4, alpha=8, seed=2, rslora=True,
                                targets=["q_proj", "v_proj", "down_proj"]),
    }
    prompts = _prompts()
    want = _reference(model, adapters, prompts)
    for name in adapters:  # the adapters change the output (else this test proves nothing)
        assert any(want[(name, i)] != want[(None, i)] for i in range(len(prompts))), name
    # a small step budget: prompts run in chunks beside other rows' decodes
    with LLM(model=str(model), enable_lora=True, max_lora_rank=8, num_kv_blocks=96,
             block_size=4, max_num_batched_tokens=16, max_num_seqs=16,
             lora_modules={k: str(v) for k, v in adapters.items()}) as llm:
        jobs = [(name, i) for i in range(len(prompts)) for name in (None, *adapters)]
        outs = llm.generate([prompts[i] for _, i in jobs], [_params(n) for n, _ in jobs])
        assert {job: o.token_ids for job, o in zip(jobs, outs)} == want
        for name, i in jobs[:4]:  # alone: the same tokens as in the mixed batch
            assert llm.generate(prompts[i], _params(name))[0].token_ids == want[(name, i)]
        assert _cold_events(llm) == 0  # warmup ran the LoRA step shapes


def test_speculation_and_one_adapter_per_step(tmp_path):
    """Draft-verify rows carry their sequence's adapter; max_loras=1 holds back requests of a
    second adapter until the first one's finish, the tokens unchanged."""
    model = make_tiny_checkpoint("qwen2", tmp_path / "model")
    adapters = {"x": make_adapter(model, tmp_path / "x", r=4, seed=3),
                "y": make_adapter(model, tmp_path / "y", r=8, seed=4,
                                  targets=["gate_proj", "up_proj", "o_proj", "k_proj"])}
    prompts = [p * 3 for p in _prompts()]  # repeats: the n-gram speculator drafts from them
    want = _reference(model, adapters, prompts)
    with LLM(model=str(model), enable_lora=True, max_loras=1, max_lora_rank=8,
             num_kv_blocks=128, block_size=4, speculative_ngram=3, speculative_ngram_match=2,
             max_num_seqs=16, max_num_batched_tokens=64, warmup=False,
             lora_modules={k: str(v) for k, v in adapters.items()}) as llm:
        llm.engine.speculator.cost = StepCost(per_row=0.0)  # draft wherever a copy is followed
        jobs = [(name, i) for name in ("x", None, "y") for i in range(len(prompts))]
        outs = llm.generate([prompts[i] for _, i in jobs], [_params(n) for n, _ in jobs])
        assert {job: o.token_ids for job, o in zip(jobs, outs)} == want
        assert llm.engine.stats.spec_draft_tokens > 0


def test_tensor_parallel_shards_adapters(tmp_path):
    """TP2: B's rows split with q/k/v and gate/up, A's columns with o and down."""
    model = make_tiny_checkpoint("llama", tmp_path / "model", bias=True)
    adapters = {"a": make_adapter(model, tmp_path / "a", r=8, seed=5)}
    prompts = _prompts()
    want = _reference(model, adapters, prompts)
    with LLM(model=str(model), tensor_parallel_size=2, enable_lora=True, max_lora_rank=8,
             num_kv_blocks=64, block_size=8, max_num_seqs=8, warmup=False,
             lora_modules={"a": str(adapters["a"])}) as llm:
        jobs = [(name, i) for i in range(len(prompts)) for name in (None, "a")]
        outs = llm.generate([prompts[i] for _, i in jobs], [_params(n) for n, _ in jobs])
        assert {job: o.token_ids for job, o in zip(jobs, outs)} == want


def test_smollm_random_rank8_adapter(default_model_dir, tmp_path):
    from tests.conftest import SMALL_ENGINE

    adapter = make_adapter(default_model_dir, tmp_path / "smol", r=8, alpha=16, seed=6,
                           std=0.03)
    tok = None
    with LLM(model=str(default_model_dir), enable_lora=True, max_lora_rank=8,
             lora_modules={"smol": str(adapter)}, **SMALL_ENGINE) as llm:
        tok = llm.tokenizer
        prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):",
                                            "Once upon a time, in a small village,")]
        jobs = [(name, i) for i in range(len(prompts)) for name in (None, "smol")]
        outs = llm.generate([prompts[i] for _, i in jobs], [_params(n) for n, _ in jobs])
        got = {job: o.token_ids for job, o in zip(jobs, outs)}
    want = _reference(default_model_dir, {"smol": adapter}, prompts)
    assert any(want[("smol", i)] != want[(None, i)] for i in range(len(prompts)))
    assert got == want


def test_unknown_or_disabled_lora_name(tmp_path):
    model = make_tiny_checkpoint("llama", tmp_path / "model")
    a = make_adapter(model, tmp_path / "a", r=4)
    with LLM(model=str(model), num_kv_blocks=16, warmup=False) as llm:
        with pytest.raises(ValueError, match="lora_name: 'a' requested but LoRA is not enabled"):
            llm.generate([1, 2, 3], _params("a"))
    with LLM(model=str(model), num_kv_blocks=16, warmup=False, enable_lora=True,
             lora_modules={"a": str(a)}) as llm:
        with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'.*'a'"):
            llm.generate([1, 2, 3], _params("nope"))
        assert len(llm.generate([1, 2, 3], _params("a"))[0].token_ids) == TOKENS  # still serves
    with pytest.raises(ValueError, match="lora_name: must be a non-empty string"):
        SamplingParams(lora_name="")


def test_adapter_errors_name_the_adapter(tmp_path):
    model = make_tiny_checkpoint("llama", tmp_path / "model")
    cfg = ModelConfig.from_dir(model)
    good = make_adapter(model, tmp_path / "good", r=8)
    assert load_adapter("good", good, cfg, 8).rank == 8
    with pytest.raises(LoraAdapterError, match="'good'.*r=8 exceeds max_lora_rank 4"):
        load_adapter("good", good, cfg, 4)
    other = make_tiny_checkpoint("llama", tmp_path / "other", hidden_size=120, num_heads=6)
    wrong = make_adapter(other, tmp_path / "wrong", r=4)
    with pytest.raises(LoraAdapterError, match=r"'wrong'.*lora_B has shape \[120, 4\].*needs \[96, 4\]"):
        load_adapter("wrong", wrong, cfg, 8)
    with pytest.raises(LoraAdapterError, match="'gone'.*no such directory"):
        load_adapter("gone", tmp_path / "gone", cfg, 8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraAdapterError, match="'empty'.*adapter_config.json not found"):
        load_adapter("empty", tmp_path / "empty", cfg, 8)
    (tmp_path / "empty" / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(LoraAdapterError, match="'empty'.*adapter_model.safetensors not found"):
        load_adapter("empty", tmp_path / "empty", cfg, 8)
    dora = json.loads((good / "adapter_config.json").read_text()) | {"use_dora": True}
    (good / "adapter_config.json").write_text(json.dumps(dora))
    with pytest.raises(LoraAdapterError, match="'good'.*use_dora=True is not supported"):
        load_adapter("good", good, cfg, 8)
    head = make_adapter(model, tmp_path / "head", r=4, targets=["q_proj", "lm_head"])
    with pytest.raises(LoraAdapterError, match="'head'.*target_modules \\['lm_head'\\]"):
        load_adapter("head", head, cfg, 8)
    # at engine start: the error names the adapter, and nothing is left running
    big = make_adapter(model, tmp_path / "big", r=8)
    with pytest.raises(LoraAdapterError, match="'big'.*exceeds max_lora_rank 4"):
        LLM(model=str(model), num_kv_blocks=16, enable_lora=True, max_lora_rank=4,
            lora_modules={"big": str(big)})


def test_settings_are_checked(tmp_path):
    from backend.engine.config import EngineConfig

    for kw, msg in ((dict(lora_modules={"a": "/x"}), "enable_lora is false"),
                    (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank"),
                    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
                    (dict(enable_lora=True, max_loras=1, max_cpu_loras=1,
                          lora_modules={"a": "/a", "b": "/b"}),
                     "more than max_cpu_loras"),
                    (dict(enable_lora=True, lora_modules={"": "/a"}), "lora_modules")):
        with pytest.raises(ValueError, match=msg):
            EngineConfig(device="cpu", **kw).validate()


def test_prefix_cache_keys_differ_per_adapter():
    kv = KVCacheManager(8, 4)
    seqs = [Sequence(str(i), list(range(9)), 9, SamplingParams(), i, lora_id=i) for i in (0, 1, 2)]
    keys = [kv._keys(s, 2) for s in seqs]
    assert len({k[0] for k in keys}) == 3 and len({k[1] for k in keys}) == 3
