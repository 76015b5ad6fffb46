"""backend.model.rope_scaling against transformers' own rotary embedding modules, bit for bit on CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.models.stablelm.modeling_stablelm import StableLmRotaryEmbedding

from backend.model.rope_scaling import SUPPORTED_ROPE_TYPES, rope_frequencies, rope_tables


def _llama3(f=8.0, lo=1.0, hi=4.0, orig=1024):
    return {"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
            "original_max_position_embeddings": orig}


def _factors(n, lo, hi):
    return [lo + (hi - lo) * i / max(n - 1, 1) for i in range(n)]


# (id, config class, rotary module, config kwargs, partial_rotary_factor, positions compared)
# max_position_embeddings is 2048 unless set; `positions` is the exact range: every served position
# for static types, up to max_position_embeddings for dynamic, up to original for longrope's short half.
CASES = [
    ("default-llama-h64", transformers.LlamaConfig, LlamaRotaryEmbedding,
     dict(head_dim=64, rope_theta=10000.0), 1.0, 2048),
    ("default-qwen3-h128-rope_parameters", transformers.Qwen3Config, Qwen3RotaryEmbedding,
     dict(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), 1.0, 2048),
    ("default-stablelm-h64-partial0.25", transformers.StableLmConfig, StableLmRotaryEmbedding,
     dict(rope_theta=10000.0), 0.25, 2048),
    ("default-phi-h16-partial0.5", transformers.PhiConfig, PhiRotaryEmbedding,
     dict(hidden_size=64, rope_theta=10000.0), 0.5, 2048),
    ("linear-llama-h64-legacy-type", transformers.LlamaConfig, LlamaRotaryEmbedding,
     dict(head_dim=64, rope_scaling={"type": "linear", "factor": 4.0}), 1.0, 2048),
    ("linear-phi-h64-partial0.75", transformers.PhiConfig, PhiRotaryEmbedding,
     dict(rope_scaling={"rope_type": "linear", "factor": 3.0}), 0.75, 2048),
    # 1.62 * 1280 / 1280 - 0.62 != 1.0 in doubles: transformers' NTK base is not exactly theta here
    ("dynamic-llama-h128", transformers.LlamaConfig, LlamaRotaryEmbedding,
     dict(head_dim=128, max_position_embeddings=1280, rope_scaling={"rope_type": "dynamic", "factor": 1.62}),
     1.0, 1280),
    ("dynamic-phi-h64-partial0.5", transformers.PhiConfig, PhiRotaryEmbedding,
     dict(rope_scaling={"type": "dynamic", "factor": 2.0}), 0.5, 2048),
    ("llama3-llama-h128", transformers.LlamaConfig, LlamaRotaryEmbedding,
     dict(head_dim=128, max_position_embeddings=8192, rope_theta=500000.0, rope_scaling=_llama3()), 1.0, 8192),
    ("llama3-llama-h64-top-level-original", transformers.LlamaConfig, LlamaRotaryEmbedding,
     dict(head_dim=64, max_position_embeddings=8192, rope_theta=500000.0, original_max_position_embeddings=512,
          rope_scaling=_llama3(f=32.0, orig=2048)), 1.0, 8192),
    ("yarn-qwen3-h128-default-truncate", transformers.Qwen3Config, Qwen3RotaryEmbedding,
     dict(head_dim=128, max_position_embeddings=8192, rope_parameters={
         "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "rope_theta": 1000000.0}),
     1.0, 8192),
    ("yarn-qwen3-h64-no-truncate-betas", transformers.Qwen3Config, Qwen3RotaryEmbedding,
     dict(head_dim=64, max_position_embeddings=8192, rope_theta=150000.0, rope_scaling={
         "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "truncate": False,
         "beta_fast": 16.0, "beta_slow": 2.0}), 1.0, 8192),
    ("yarn-llama-h16-attention_factor", transformers.LlamaConfig, LlamaRotaryEmbedding,
     dict(head_dim=16, max_position_embeddings=4096, rope_scaling={
         "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
         "attention_factor": 0.75}), 1.0, 4096),
    ("yarn-deepseekv3-h64-mscale", transformers.DeepseekV3Config, DeepseekV3RotaryEmbedding,
     dict(qk_rope_head_dim=64, max_position_embeddings=16384, rope_theta=10000.0, rope_scaling={
         "type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 1.0,
         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}), 1.0, 4096),
    ("yarn-llama-h64-mscale-only", transformers.LlamaConfig, LlamaRotaryEmbedding,
     dict(head_dim=64, max_position_embeddings=4096, rope_scaling={
         "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "mscale": 1.0}),
     1.0, 4096),
    ("yarn-phi-h64-partial0.5", transformers.PhiConfig, PhiRotaryEmbedding,
     dict(max_position_embeddings=4096, rope_scaling={
         "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048}), 0.5, 4096),
    ("longrope-phi3-h64-partial0.75-ratio", transformers.Phi3Config, Phi3RotaryEmbedding,
     dict(max_position_embeddings=8192, original_max_position_embeddings=1024, rope_scaling={
         "type": "longrope", "short_factor": _factors(24, 1.0, 1.5), "long_factor": _factors(24, 1.1, 6.0)}),
     0.75, 1024),
    ("longrope-phi3-h128-su-factor", transformers.Phi3Config, Phi3RotaryEmbedding,
     dict(hidden_size=512, max_position_embeddings=4096, original_max_position_embeddings=2048, rope_scaling={
         "type": "su", "factor": 3.0, "short_factor": _factors(64, 1.0, 1.2),
         "long_factor": _factors(64, 1.0, 9.0)}), 1.0, 2048),
    ("longrope-phi3-h64-attention_factor", transformers.Phi3Config, Phi3RotaryEmbedding,
     dict(max_position_embeddings=4096, original_max_position_embeddings=1024, rope_scaling={
         "rope_type": "longrope", "attention_factor": 1.25, "short_factor": _factors(32, 1.0, 2.0),
         "long_factor": _factors(32, 3.0, 4.0)}), 1.0, 1024),
]


def _build(cfg_cls, kwargs, partial):
    # transformers standardizes the rope dict it is given in place: hand it a copy
    kw = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048)
    kw.update(copy.deepcopy(kwargs))
    if partial != 1.0:
        kw["partial_rotary_factor"] = partial
    return cfg_cls(**kw)


def _head_dim(cfg):
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _ours(cfg, kwargs, partial, n):
    # what the engine reads from config.json: the raw scaling dict and the top-level values, not the
    # dict transformers standardized (which already folds the top-level ones in)
    scaling = kwargs.get("rope_scaling") or kwargs.get("rope_parameters")
    freqs = rope_frequencies(int(_head_dim(cfg) * partial), kwargs.get("rope_theta", 10000.0), scaling,
                             cfg.max_position_embeddings, kwargs.get("original_max_position_embeddings"))
    return freqs, rope_tables(freqs, n, torch.float32)


def _theirs(rot, cfg, positions):
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rot(x, positions[None, :])
    return cos[0], sin[0]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_transformers(case):
    _, cfg_cls, rot_cls, kwargs, partial, exact = case
    cfg = _build(cfg_cls, kwargs, partial)
    rot = rot_cls(cfg)
    freqs, (cos, sin) = _ours(cfg, kwargs, partial, exact)
    assert freqs.inv_freq.dtype == torch.float32
    assert freqs.attention_factor == rot.attention_scaling
    assert torch.equal(freqs.inv_freq, rot.original_inv_freq)
    assert cos.shape == (exact, int(_head_dim(cfg) * partial))

    their_cos, their_sin = _theirs(rot, cfg, torch.arange(exact))
    assert torch.equal(cos, their_cos) and torch.equal(sin, their_sin)

    # bf16 is a cast of the same float32 table, as in the HF forward
    n = min(exact, 1024)
    bcos, bsin = rope_tables(freqs, n, torch.bfloat16)
    hcos, hsin = rot(torch.zeros(1, dtype=torch.bfloat16), torch.arange(n)[None, :])
    assert torch.equal(bcos, hcos[0]) and torch.equal(bsin, hsin[0])

    if freqs.switch_at is not None:
        # longrope: a longer forward uses the long factors, which our table serves from switch_at on
        n = freqs.switch_at + 300
        _, (lcos, lsin) = _ours(cfg, kwargs, partial, n)
        their_cos, their_sin = _theirs(rot, cfg, torch.arange(n))
        assert torch.equal(lcos[freqs.switch_at:], their_cos[freqs.switch_at:])
        assert torch.equal(lsin[freqs.switch_at:], their_sin[freqs.switch_at:])
        assert torch.equal(freqs.long_inv_freq, rot.long_inv_freq)


def test_unknown_rope_type_names_the_supported_ones():
    with pytest.raises(ValueError) as err:
        rope_frequencies(64, 10000.0, {"rope_type": "mystery", "factor": 2.0}, 2048)
    for name in SUPPORTED_ROPE_TYPES:
        assert name in str(err.value)
    with pytest.raises(ValueError):
        rope_frequencies(64, 10000.0, {"type": "proportional"}, 2048)


def test_longrope_switches_per_position():
    short, long = [1.0] * 8, [4.0] * 8
    freqs = rope_frequencies(16, 10000.0, {"rope_type": "longrope", "short_factor": short, "long_factor": long},
                             max_position_embeddings=256, original_max_position_embeddings=64)
    assert freqs.switch_at == 64
    assert torch.equal(freqs.long_inv_freq, freqs.inv_freq / 4.0)
    cos, sin = rope_tables(freqs, 128, torch.float32)
    af = freqs.attention_factor
    assert af > 1.0
    pos = torch.arange(128, dtype=torch.float32)[:, None]
    expect_short = (pos * freqs.inv_freq).repeat(1, 2)
    expect_long = (pos * freqs.long_inv_freq).repeat(1, 2)
    assert torch.equal(cos[:64], expect_short[:64].cos() * af)
    assert torch.equal(cos[64:], expect_long[64:].cos() * af)
    assert torch.equal(sin[64:], expect_long[64:].sin() * af)
    assert not torch.equal(cos[64:], expect_short[64:].cos() * af)
    # a table that ends before switch_at is all short
    cos_s, _ = rope_tables(freqs, 32, torch.float32)
    assert torch.equal(cos_s, cos[:32])
