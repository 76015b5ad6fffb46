"""Tiny random checkpoints of every family we load, made with transformers, saved as safetensors.

Each family's tiny config exercises what sets it apart (backend/model/family.py): GQA ratios
other than 2, head_dim != hidden / heads, tied and untied heads, sliding windows shorter than
the tests' prompts, soft caps that bite, partial rotary with longrope."""
from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "phi3")
# mixture-of-experts families: make_tiny_checkpoint makes them too, but they are not in ARCHS
# (ARCHS' tests expect the fused C++ decode path, which MoE models do not take: test_moe.py)
MOE_ARCHS = ("mixtral", "qwen3_moe", "olmoe")
# a window the tests' prompts (30 tokens and more) outgrow
TINY_WINDOW = 8


def make_tiny_checkpoint(arch: str, out_dir: Path, vocab_size: int = 512, seed: int = 0,
                         num_heads: int = 6, num_kv_heads: int = 2, layers: int = 2,
                         shards: int = 1, tokenizer_dir: Path | None = None,
                         bias: bool = False, hidden_size: int = 96) -> Path:
    """A random checkpoint; with `tokenizer_dir`, its tokenizer files are copied in and the
    vocabulary sized to match, so the engine can take text. `bias` (Llama): attention_bias and
    mlp_bias, so q/k/v/o and gate/up/down all carry biases. head_dim is hidden_size / num_heads
    (16 by default; 64, the hand-tiled attention kernels' size, with e.g. 192 / 3)."""
    import shutil

    import transformers as tf

    if tokenizer_dir is not None:
        vocab_size = tf.AutoTokenizer.from_pretrained(tokenizer_dir).vocab_size

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=160,
                  num_hidden_layers=layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=50000.0, attention_bias=bias, mlp_bias=bias)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=TINY_WINDOW)
        cls = tf.MistralForCausalLM
    elif arch == "qwen3":  # head_dim 24 != 96 / 6, GQA 3, tied
        cfg = tf.Qwen3Config(**{**common, "tie_word_embeddings": True}, head_dim=24)
        cls = tf.Qwen3ForCausalLM
    elif arch == "gemma2":  # caps small enough to bite on these logits
        cfg = tf.Gemma2Config(**{**common, "tie_word_embeddings": True}, head_dim=32,
                              query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
                              attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
                              pad_token_id=0)
        cls = tf.Gemma2ForCausalLM
    elif arch == "gemma3":  # local layers with their own rope, a global one with linear scaling
        types = ["sliding_attention", "full_attention"] * layers
        cfg = tf.Gemma3TextConfig(
            **common, head_dim=32, query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
            layer_types=types[:layers], pad_token_id=0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 1e6}})
        cls = tf.Gemma3ForCausalLM
    elif arch == "phi3":  # fused qkv / gate_up, partial rotary (3/4), longrope
        half = int(hidden_size // num_heads * 0.75) // 2
        cfg = tf.Phi3Config(
            **{**common, "max_position_embeddings": 4096}, original_max_position_embeddings=1024,
            pad_token_id=0, rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(half)],
                "long_factor": [2.0 + 0.3 * i for i in range(half)]})
        cls = tf.Phi3ForCausalLM
    elif arch == "mixtral":  # top 2 of 5 experts, every layer windowed
        cfg = tf.MixtralConfig(**common, num_local_experts=5, num_experts_per_tok=2,
                               sliding_window=TINY_WINDOW)
        cls = tf.MixtralForCausalLM
    elif arch == "qwen3_moe":  # top 3 of 8, renormalized; dense MLPs between MoE layers;
        # experts narrower than the dense MLP (a multiple of 8: transformers' grouped_mm needs
        # 16-byte strides in bfloat16)
        cfg = tf.Qwen3MoeConfig(**common, head_dim=24, num_experts=8, num_experts_per_tok=3,
                                moe_intermediate_size=72, norm_topk_prob=True,
                                decoder_sparse_step=2, mlp_only_layers=[3])
        cls = tf.Qwen3MoeForCausalLM
    elif arch == "olmoe":  # top 3 of 8, not renormalized; q/k norms over all heads, 3 KV
        # heads (under TP2 the middle one on both ranks)
        cfg = tf.OlmoeConfig(**{**common, "num_key_value_heads": 3}, num_experts=8,
                             num_experts_per_tok=3, norm_topk_prob=False)
        cls = tf.OlmoeForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    with torch.no_grad():  # random init is tiny; scale up so logits are well separated
        for name, p in model.named_parameters():
            if "norm" in name:  # away from neutral: 1 for Llama's norms, 0 for Gemma's (1 + w)
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15 if p.dim() > 1 else 0.1)
    max_shard = "100KB" if shards > 1 else "2GB"
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=max_shard)
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, out_dir / f.name)
    return out_dir


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def gguf_round_trip(w: torch.Tensor, kind: str = "Q4_1") -> torch.Tensor:
    """w as a GGUF file of that kind holds it: quantized, then dequantized to float32 as gguf
    does (the default model's layers are Q4_1, its embedding and lm_head Q8_0)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    a = w.detach().float().contiguous().numpy()
    q = quantize(a, GGMLQuantizationType[kind])
    return torch.from_numpy(dequantize(q, GGMLQuantizationType[kind]).reshape(a.shape).copy())


def requantize(model_dir: Path) -> Path:
    """Rewrites a checkpoint as the default model's GGUF holds its weights: decoder-layer
    linears as Q4_1 round trips, the lm_head (untied) as Q8_0 (gguf_round_trip)."""
    from safetensors.torch import load_file, save_file

    for f in Path(model_dir).glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if ".layers." in name and name.endswith("proj.weight"):
                tensors[name] = gguf_round_trip(t, "Q4_1")
            elif name == "lm_head.weight":
                tensors[name] = gguf_round_trip(t, "Q8_0")
        save_file(tensors, f, metadata={"format": "pt"})
    return Path(model_dir)


def greedy_references(tmp_path_factory, make, prompts: list[list[int]], tokens: int):
    """(arch) -> (its tiny checkpoint, made once by make(arch, dir), and transformers' greedy
    `tokens` tokens after each prompt): the reference a family's engine tests compare with."""
    from tests.lora_adapters import greedy
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            model = make(arch, tmp_path_factory.mktemp(arch))
            hf = hf_model(model)
            cache[arch] = (model, [greedy(hf, p, tokens) for p in prompts])
        return cache[arch]
    return get
