"""Random PEFT LoRA adapters for tests, and the reference they are checked against: transformers
with the adapter merged into the weights (peft's merge_and_unload: W + scale * B @ A)."""
from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: Path, out_dir: Path, r: int = 8, alpha: float = 16.0,
                 targets: list[str] = ALL_TARGETS, seed: int = 0, rslora: bool = False,
                 std: float = 0.2) -> Path:
    """A random adapter for the checkpoint in model_dir, saved in PEFT's format. A and B are
    drawn at `std` (PEFT's own init zeroes B: such an adapter would change nothing)."""
    from peft import LoraConfig, get_peft_model

    from tests.tiny_models import hf_model

    base = hf_model(model_dir)
    model = get_peft_model(base, LoraConfig(
        r=r, lora_alpha=alpha, target_modules=_in_checkpoint(base, targets), use_rslora=rslora,
        lora_dropout=0.0, bias="none"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _in_checkpoint(model, targets: list[str]) -> list[str]:
    """The targets as the checkpoint names its modules: Phi-3's fused qkv_proj / gate_up_proj
    stand for q/k/v and gate/up."""
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    return sorted({t if t in names else _FUSED[t] for t in targets})


def merged_model(model_dir: Path, adapter_dir: Path | None):
    """transformers' model with the adapter merged into its weights (None: the base model)."""
    from tests.tiny_models import hf_model

    base = hf_model(model_dir)
    if adapter_dir is None:
        return base
    from peft import PeftModel
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt, every step a full forward pass (no EOS stop)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
