"""`python -m client random-model NAME OUT`: a random checkpoint with a released model's shapes.

A decode step's time depends on the shapes it reads, not on the weights' values, so a family's
speed is measured on such a checkpoint (`python -m client bench offline --model OUT --compare hf`,
`bench decode --model OUT`) where the real weights cannot be downloaded. Shapes as in each
model's released config.json; transformers builds and saves it (float32 safetensors).
"""
from __future__ import annotations

import argparse
from pathlib import Path

# name -> (transformers config class, its arguments)
SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3-0.6b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})),
    "gemma3-1b": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6,
        max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
        tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})),
    "gemma2-2b": ("Gemma2Config", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=4096,
        query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=8192, tie_word_embeddings=True)),
    # Qwen3-30B-A3B's proportions at half its width and a third of its depth (the MoE issue's
    # benchmark shape): 32 experts, top 4, every layer sparse; fits a 24 GiB machine twice
    "qwen3-moe-small": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
        num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=40960,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(SHAPES))
    p.add_argument("out", type=Path, help="directory to write the checkpoint into")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None,
                   help="fewer layers than the model has (a smaller file, same per-layer shapes)")


def main(args: argparse.Namespace) -> int:
    import torch
    import transformers as tf

    cls_name, kwargs = SHAPES[args.name]
    if args.layers:
        kwargs = {**kwargs, "num_hidden_layers": args.layers}
    config = getattr(tf, cls_name)(**kwargs, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(args.seed)
    with torch.device("cpu"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # transformers' init leaves norms at their neutral value: vary them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(args.out, safe_serialization=True)
    print(f"{args.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters "
          f"in {args.out}")
    return 0
