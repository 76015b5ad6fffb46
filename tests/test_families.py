"""Every family we load (tests/tiny_models.ARCHS) with every engine feature: float32 greedy tokens
identical to transformers' in a mixed batch, alone, over a cached prefix and with n-gram
speculation, on the fused C++ decode path, nothing cold after warmup; TP2 identical to TP1;
structured output; clear load errors for what we do not serve."""
from __future__ import annotations

import json

import pytest
import torch

from backend import LLM, SamplingParams
from backend.model.config import ModelConfig
from backend.model.errors import ModelLoadError
from tests.lora_adapters import greedy
from tests.tiny_models import (ARCHS, TINY_WINDOW, greedy_references, hf_model,
                               make_tiny_checkpoint)

TOKENS = 12
ENGINE = dict(num_kv_blocks=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)


def _prompts() -> list[list[int]]:
    """Prompts longer than the tiny window, with repeats the n-gram speculator drafts from."""
    gen = torch.Generator().manual_seed(11)
    heads = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 13, 20)]
    return [p * 2 for p in heads]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """(arch) -> its tiny checkpoint and transformers' greedy tokens for _prompts()."""
    return greedy_references(tmp_path_factory, make_tiny_checkpoint, _prompts(), TOKENS)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_on_every_path(arch, family):
    model, want = family(arch)
    assert max(len(p) for p in _prompts()) > TINY_WINDOW
    prompts = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    # matches of one token: drafts on any random checkpoint (their outputs rarely repeat longer)
    with LLM(model=str(model), speculative_ngram=3, speculative_ngram_match=1, **ENGINE) as llm:
        engine_model = llm.engine.runner.model
        assert [o.token_ids for o in llm.generate(prompts, [sp] * len(prompts))] == want
        # alone, each over its cached prompt (the batch above left it in the prefix cache)
        alone = [llm.generate(p, sp)[0] for p in prompts]
        assert [o.token_ids for o in alone] == want
        assert all(o.num_cached_tokens > 0 for o, p in zip(alone, prompts) if len(p) > 8)
        stats = llm.stats
        assert stats["spec_draft_tokens"] > 0
        assert stats["cold_path"] == {}
        # the decode steps ran on the fused C++ stack with the family's parts
        assert engine_model.fused_steps > 0


def test_blocks_behind_every_layers_window_are_released(family):
    """Every layer windowed (Mistral): a sequence holds its window's blocks, not its context's,
    so a context several times the KV pool decodes, token-exact; the pool is whole again after."""
    model, _ = family("mistral")
    prompt = _prompts()[2]  # 40 tokens; with 40 more, 20 blocks of 4: the pool has 8
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = greedy(hf_model(model), prompt, 40)
    with LLM(model=str(model), **{**ENGINE, "num_kv_blocks": 8}) as llm:
        assert llm.engine.kv.window == TINY_WINDOW
        assert llm.generate(prompt, sp)[0].token_ids == want
        assert llm.generate([prompt, prompt[::-1]], [sp, sp])[1].token_ids == greedy(
            hf_model(model), prompt[::-1], 40)
        assert llm.engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_matches_tp1(arch, family):
    model, want = family(arch)
    prompts = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    with LLM(model=str(model), tensor_parallel_size=2, **ENGINE) as llm:
        assert [o.token_ids for o in llm.generate(prompts, [sp] * len(prompts))] == want


@pytest.mark.parametrize("arch", ARCHS)
def test_structured_output(arch, tmp_path, default_model_dir):
    model = make_tiny_checkpoint(arch, tmp_path, tokenizer_dir=default_model_dir)
    # bounded values: a random model's digits need not stop before max_tokens
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "pick": {"enum": ["a", "b"]}},
              "required": ["ok", "pick"], "additionalProperties": False}
    sp = SamplingParams(temperature=0, max_tokens=48, guided_json=schema)
    with LLM(model=str(model), **ENGINE) as llm:
        out = llm.generate("Give a number:", sp)[0]
    assert out.finish_reason == "stop", out
    got = json.loads(out.text)
    assert isinstance(got["ok"], bool) and got["pick"] in ("a", "b")


def test_unsupported_families_and_rope_types_name_what_is_supported():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2)
    with pytest.raises(ModelLoadError, match="supported: llama, mistral, qwen2, qwen3, gemma2"):
        ModelConfig.from_dict({**base, "model_type": "gpt2"})
    with pytest.raises(ModelLoadError, match="rope type 'su2'.*yarn, longrope"):
        ModelConfig.from_dict({**base, "model_type": "llama", "rope_scaling": {"type": "su2"}})
    with pytest.raises(ModelLoadError, match="hidden_activation 'relu'"):
        ModelConfig.from_dict({**base, "model_type": "gemma2", "hidden_activation": "relu"})


def test_released_config_spellings():
    """Configs as released checkpoints spell them: Gemma 3's rope_local_base_freq and pattern,
    Phi-3's longrope named su, the multimodal gemma3's text_config."""
    g = ModelConfig.from_dict({
        "model_type": "gemma3", "text_config": {
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 12,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        "eos_token_id": [1, 106]})
    assert g.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 4096 for i in range(12))
    assert (g.rope_theta, g.local_rope_theta, g.local_rope_scaling) == (1e6, 1e4, None)
    assert g.rope_scaling["factor"] == 8.0 and g.head_dim == 256 and g.tie_word_embeddings
    assert g.attention_scale == 256 ** -0.5 and g.eos_token_ids == (1, 106)
    p = ModelConfig.from_dict({
        "model_type": "phi3", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "partial_rotary_factor": 0.75,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}})
    assert p.rope_scaling["rope_type"] == "longrope" and p.rotary_dim == 12
    assert p.original_max_position_embeddings == 4096
    # sliding_attention layers with a null window attend to everything, as transformers runs them
    g2 = ModelConfig.from_dict({
        "model_type": "gemma2", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "sliding_window": None,
        "layer_types": ["sliding_attention", "full_attention"]})
    assert g2.layer_windows == (0, 0) and g2.attn_softcap == 50.0


def test_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path):
    """A gemma3 (image + text) checkpoint: its language_model tensors load, the vision tower's
    are skipped; prompt logits equal transformers' Gemma3ForConditionalGeneration on text."""
    import transformers as tf

    from tests.test_model_fidelity import _our_logits

    text = tf.Gemma3TextConfig(
        vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=TINY_WINDOW, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256, pad_token_id=0)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    hf = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=5,
        boi_token_index=3, eoi_token_index=4)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(6, 512, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = _our_logits(tmp_path, ids, [7, 9] + [1] * 4)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-4
