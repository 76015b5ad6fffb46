"""Mixture-of-experts families (tests/tiny_models.MOE_ARCHS: Mixtral top 2 of 5 experts,
Qwen3-MoE top 3 of 8 with dense MLPs between its MoE layers, OLMoE top 3 of 8 with q/k norms
over all heads): float32 logits and greedy tokens as transformers', from the per-expert tensors
transformers saves and from its stacked ones; a batch, a cached prefix and n-gram speculation
token-exact on the modular path (no fused decode); TP2 identical to TP1; the routing itself
against transformers' MoE block; clear load errors for what we do not serve."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend import LLM, SamplingParams
from backend.model.config import ModelConfig
from backend.model.errors import ModelLoadError
from backend.model.llama import MLP
from backend.model.loader import load_model
from backend.model.moe import MoE
from backend.parallel.context import ParallelContext
from tests.test_families import ENGINE, TOKENS, _prompts
from tests.test_model_fidelity import _our_logits
from tests.tiny_models import (MOE_ARCHS, TINY_WINDOW, greedy_references, hf_model,
                               make_tiny_checkpoint)

# Qwen3-MoE: decoder_sparse_step 2 makes layers 1, 3, 5 MoE and mlp_only_layers [3] takes 3 back
LAYERS = {"qwen3_moe": 6}
MOE_LAYERS = {"mixtral": (0, 1), "qwen3_moe": (1, 5), "olmoe": (0, 1)}


def _prompts_with_drafts() -> list[list[int]]:
    """test_families' prompts and one of 160 tokens: a quarter of the vocabulary, so most tokens
    a random model emits occurred before, and the n-gram speculator drafts (its drafts are
    what is checked; the short prompts alone drew none from the tiny Mixtral)."""
    gen = torch.Generator().manual_seed(12)
    return _prompts() + [torch.randint(3, 512, (160,), generator=gen).tolist()]


def _make(arch: str, out_dir: Path) -> Path:
    return make_tiny_checkpoint(arch, out_dir, layers=LAYERS.get(arch, 2))


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """(arch) -> its tiny checkpoint and transformers' greedy tokens for the prompts."""
    return greedy_references(tmp_path_factory, _make, _prompts_with_drafts(), TOKENS)


def _stack_experts(model_dir: Path) -> None:
    """Rewrites a checkpoint's per-expert tensors as transformers holds them in memory:
    mlp.experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I], the
    router as mlp.gate (Mixtral's block_sparse_moe renamed)."""
    parts = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up",
             "w2": "down", "down_proj": "down"}
    for f in model_dir.glob("*.safetensors"):
        tensors = load_file(f)
        out, experts = {}, {}
        for name, t in tensors.items():
            name = name.replace(".block_sparse_moe.", ".mlp.")
            if ".mlp.experts." not in name:
                out[name] = t
                continue
            prefix, rest = name.split(".mlp.experts.")
            e, proj, _ = rest.split(".")
            experts.setdefault(prefix, {}).setdefault(parts[proj], {})[int(e)] = t
        for prefix, by in experts.items():
            n = len(by["gate"])
            out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([by["gate"][e], by["up"][e]]) for e in range(n)])
            out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([by["down"][e] for e in range(n)])
        save_file(out, f, metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_match_transformers(arch, layout, tmp_path):
    model_dir = _make(arch, tmp_path)
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (30,)).tolist()
    with torch.no_grad():
        ref = hf_model(model_dir)(torch.tensor([ids])).logits[0]
    if layout == "stacked":
        _stack_experts(model_dir)
        assert not any(".experts.0." in k for k in load_file(next(model_dir.glob("*.safetensors"))))
    # prefill in uneven chunks (one over a cached prefix), then single-token decode steps
    ours = _our_logits(model_dir, ids, [7, 10, 5] + [1] * 8)
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, f"{arch}: relative logits error {rel:.2e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_bfloat16_as_accurate_as_transformers(arch, tmp_path):
    """bfloat16: our error against the float32 reference is no worse than transformers' own
    bfloat16 error (routing weights rounded where the family rounds them, expert sums in
    float32)."""
    model_dir = _make(arch, tmp_path)
    torch.manual_seed(2)
    ids = torch.randint(0, 512, (30,)).tolist()
    ours = _our_logits(model_dir, ids, [7, 10, 5] + [1] * 8, torch.bfloat16)
    with torch.no_grad():
        ref = hf_model(model_dir)(torch.tensor([ids])).logits[0]
        hf_bf16 = hf_model(model_dir, torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    scale = ref.abs().max()
    ours_err = ((ours - ref).abs().max() / scale).item()
    hf_err = ((hf_bf16 - ref).abs().max() / scale).item()
    assert ours_err <= max(1.5 * hf_err, 1e-2), f"{arch}: ours {ours_err:.2e} vs HF {hf_err:.2e}"


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_matches_transformers_on_every_path(arch, family):
    """A mixed batch, each prompt alone over its cached prefix, n-gram speculation: every step
    on the modular path (the fused decode stack has no experts), nothing cold after warmup."""
    model, want = family(arch)
    prompts = _prompts_with_drafts()
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    with LLM(model=str(model), speculative_ngram=3, speculative_ngram_match=1, **ENGINE) as llm:
        engine_model = llm.engine.runner.model
        assert not engine_model.fused_decode
        assert [o.token_ids for o in llm.generate(prompts, [sp] * len(prompts))] == want
        alone = [llm.generate(p, sp)[0] for p in prompts]
        assert [o.token_ids for o in alone] == want
        assert all(o.num_cached_tokens > 0 for o, p in zip(alone, prompts) if len(p) > 8)
        stats = llm.stats
        assert stats["spec_draft_tokens"] > 0
        assert stats["cold_path"] == {}
        assert engine_model.fused_steps == 0


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tp2_matches_tp1(arch, family):
    """Each rank holds every expert's share of its intermediate dim (one all-reduce per MoE
    layer); OLMoE's q/k norms sum their squares across ranks (its 3 KV heads: the middle one
    on both ranks, counted once)."""
    model, want = family(arch)
    prompts = _prompts_with_drafts()
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    with LLM(model=str(model), tensor_parallel_size=2, num_threads=1, **ENGINE) as llm:
        assert [o.token_ids for o in llm.generate(prompts, [sp] * len(prompts))] == want


def _blocks(model_dir: Path):
    """(our model, transformers' model) of a checkpoint."""
    cfg = ModelConfig.from_dir(model_dir)
    return load_model(model_dir, cfg, ParallelContext(), torch.float32), hf_model(model_dir)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routing_matches_transformers_block(arch, tmp_path):
    """Each MoE layer alone against transformers' sparse MoE block: the same experts in the
    same order for every row, the same output, from batches where experts get uneven row
    counts and some none (one row takes k of them); grouped by expert or (a CUDA graph's way)
    every expert over every row, the same values."""
    ours, hf = _blocks(_make(arch, tmp_path))
    kinds = [isinstance(layer.mlp, MoE) for layer in ours.layers]
    assert tuple(i for i, moe in enumerate(kinds) if moe) == MOE_LAYERS[arch]
    hf_layers = hf.model.layers
    for i, layer in enumerate(ours.layers):
        assert isinstance(layer.mlp, MoE) == hasattr(hf_layers[i].mlp, "experts")
        assert isinstance(layer.mlp, MoE) or isinstance(layer.mlp, MLP)
    gen = torch.Generator().manual_seed(3)
    for i in MOE_LAYERS[arch]:
        moe, ref = ours.layers[i].mlp, hf_layers[i].mlp
        for rows in (1, 3, 17):
            x = torch.randn(rows, hf.config.hidden_size, generator=gen)
            with torch.no_grad():
                _, ref_weights, ref_experts = ref.gate(x)
                want = ref(x.unsqueeze(0))[0]
            weights, chosen = moe.route(x)
            assert torch.equal(chosen, ref_experts)
            torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
            counts = torch.bincount(chosen.flatten(), minlength=moe.gate.weight.shape[0])
            if rows == 1:
                assert (counts == 0).any()  # experts without rows this step
            got = moe(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            every = moe._combine(moe._every_expert(x, chosen), weights, x.dtype)
            torch.testing.assert_close(every, got, rtol=1e-6, atol=1e-6)


def test_qwen3_moe_layer_kinds_from_config():
    """decoder_sparse_step and mlp_only_layers as transformers reads them; no experts at all
    is a dense model."""
    base = dict(model_type="qwen3_moe", vocab_size=32, hidden_size=64, intermediate_size=128,
                num_hidden_layers=8, num_attention_heads=4, num_experts=16,
                num_experts_per_tok=4, moe_intermediate_size=32)
    assert ModelConfig.from_dict(base).moe_layers == tuple(range(8))
    cfg = ModelConfig.from_dict({**base, "decoder_sparse_step": 3, "mlp_only_layers": [5]})
    assert cfg.moe_layers == (2,)
    assert ModelConfig.from_dict({**base, "num_experts": 0}).moe_layers == ()
    # transformers' Qwen3MoeConfig saves the count as num_local_experts
    saved = {k: v for k, v in base.items() if k != "num_experts"}
    assert ModelConfig.from_dict({**saved, "num_local_experts": 6}).num_experts == 6
    # Mixtral renormalizes the top k whatever config.json says; Qwen3-MoE as it says
    assert not ModelConfig.from_dict(base).norm_topk_prob
    assert ModelConfig.from_dict({**base, "norm_topk_prob": True}).norm_topk_prob
    mixtral = ModelConfig.from_dict({**base, "model_type": "mixtral", "num_experts": None,
                                     "num_local_experts": 8, "norm_topk_prob": False})
    assert mixtral.norm_topk_prob and mixtral.num_experts == 8
    assert mixtral.moe_intermediate_size == 128  # Mixtral's experts are intermediate_size wide
    assert mixtral.layer_windows == (0,) * 8
    windowed = ModelConfig.from_dict({**base, "use_sliding_window": True,
                                      "sliding_window": TINY_WINDOW})
    assert windowed.layer_windows == (TINY_WINDOW,) * 8  # every layer (no max_window_layers)


@pytest.mark.parametrize("option, message", [
    ({"scoring_func": "sigmoid"}, "unsupported scoring_func='sigmoid'"),
    ({"n_shared_experts": 2}, "unsupported n_shared_experts=2"),
    ({"shared_expert_intermediate_size": 64}, "unsupported shared_expert_intermediate_size"),
    ({"routed_scaling_factor": 2.5}, "unsupported routed_scaling_factor=2.5"),
    ({"clip_qkv": 8.0}, "unsupported clip_qkv=8.0"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 of 8 experts"),
])
def test_unsupported_router_options_fail_the_load(option, message, tmp_path):
    model_dir = _make("olmoe", tmp_path)
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **option}))
    with pytest.raises(ModelLoadError, match=message):
        LLM(model=str(model_dir), **ENGINE)


def test_missing_expert_and_stray_expert_tensors_are_named(tmp_path):
    model_dir = _make("mixtral", tmp_path)
    f = next(model_dir.glob("*.safetensors"))
    tensors = load_file(f)
    gone = tensors.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight")
    save_file(tensors, f, metadata={"format": "pt"})
    cfg = ModelConfig.from_dir(model_dir)
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensors.*experts\.gate_up_proj\[expert 3\]"
                                             r"\[up\]"):
        load_model(model_dir, cfg, ParallelContext(), torch.float32)
    tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"] = gone
    tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"] = gone.clone()  # 5: 0-4
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="unexpected tensor.*experts.5.w3"):
        load_model(model_dir, cfg, ParallelContext(), torch.float32)


def test_lora_adapters_are_refused_on_moe_models(tmp_path):
    """The experts take no adapters; an adapter of attention only is refused too (the adapter
    slots attach to every layer's dense MLP)."""
    model_dir = _make("qwen3_moe", tmp_path / "model")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(4, 96),
               f"{prefix}.lora_B.weight": torch.zeros(144, 4)},
              adapter / "adapter_model.safetensors")
    with pytest.raises(ModelLoadError, match="not served on mixture-of-experts models"):
        LLM(model=str(model_dir), enable_lora=True, lora_modules={"a": str(adapter)}, **ENGINE)
