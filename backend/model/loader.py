"""Load a Hugging Face checkpoint directory into our model, reading only this rank's slices."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from backend.model import host_memory
from backend.model.config import ModelConfig
from backend.model.errors import ModelLoadError
from backend.model.checkpoint_names import checkpoint_targets
from backend.model.layers import RMSNorm
from backend.model.llama import LlamaForCausalLM
from backend.model.rotary import head_permutation, permute_head_rows
from backend.parallel.context import ParallelContext

log = logging.getLogger("backend.model")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: invalid safetensors index ({e})") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"{f}: listed in {index.name} but missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        hint = " (only .bin weights found; convert them to safetensors)" if any(
            model_dir.glob("*.bin")) else ""
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights{hint}")
    return files


def load_model(model_dir: Path, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
               device: torch.device | str | None = None) -> LlamaForCausalLM:
    """Parameters are created on `device` (default: torch's default device) and each slice is
    copied there straight from the file; the model picks its kernels by that device."""
    device = torch.device(device if device is not None else torch.get_default_device())
    with device:
        model = LlamaForCausalLM(cfg, ctx, dtype)
    if device.type == "cpu":
        host_memory.move_parameters(model)  # huge pages: decode streams every weight per token
    params = dict(model.named_parameters(remove_duplicate=False))
    # (parameter, shard, expert): stacked experts' parameters need each expert's slice
    needed = {(n, sid, e) for n, p in params.items() for sid in p.shards for e in _experts(p)
              if not (n == "lm_head.weight" and cfg.tie_word_embeddings)}
    loaded: set[tuple[str, str | None, int | None]] = set()
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    for t in checkpoint_targets(key, cfg):
                        p = params.get(t.param)
                        if p is None or t.shard not in p.shards or (
                                t.expert is not None and not 0 <= t.expert < len(_experts(p))):
                            raise ModelLoadError(f"{path}: unexpected tensor {key!r} for a "
                                                 f"{cfg.model_type} model")
                        _load_slice(p, t.shard, f.get_slice(key), path, key, t.source_offset,
                                    t.expert)
                        loaded.update((t.param, t.shard, e) for e in (
                            _experts(p) if t.expert is None else (t.expert,)))
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: unreadable safetensors file ({e})") from None
    missing = needed - loaded
    model.generates = ("lm_head.weight", None, None) not in missing
    if not model.generates and len({n for n, _, _ in missing}) == 1:
        # an embedding checkpoint (a base model: no lm_head): it embeds; generating is refused
        # per request (its head stays zeros, for warmup's steps only)
        log.info("%s has no lm_head: serving embeddings only", model_dir)
        missing = set()
    if missing:
        names = ", ".join(sorted(_described(*m) for m in missing)[:5])
        raise ModelLoadError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {names}")
    log.info("loaded %s (%d tensors) rank %d/%d", model_dir, len(loaded), ctx.rank, ctx.world_size)
    to_kernel_layout(model, cfg)
    return model.eval()


@torch.no_grad()
def to_kernel_layout(model: LlamaForCausalLM, cfg: ModelConfig) -> None:
    """What the family's checkpoint stores, in the form our kernels compute with: Gemma's norm
    weights w as (1 + w) (its RMSNorm multiplies by that, in float32), and with partial rotary
    each q and k head's rows in rotary.head_permutation's order."""
    offset = cfg.family.norm_offset
    if offset:
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(m.weight.float() + offset)
    perm = head_permutation(cfg)
    if perm is None:
        return
    for layer in model.layers:
        attn = layer.self_attn
        qk = (attn.num_q + attn.num_kv) * cfg.head_dim  # v's rows keep their order
        for p in (attn.qkv_proj.weight, attn.qkv_proj.bias):
            if p is not None:
                p[:qk].copy_(permute_head_rows(p[:qk], perm, cfg.head_dim))


def _experts(param: torch.nn.Parameter) -> tuple[int | None, ...]:
    """The experts whose slices a parameter stacks ((None,): not a stacked one)."""
    n = getattr(param, "num_experts", 0)
    return tuple(range(n)) if n else (None,)


def _described(name: str, sid: str | None, expert: int | None) -> str:
    return name + (f"[expert {expert}]" if expert is not None else "") + (f"[{sid}]" if sid else "")


def _load_slice(param: torch.nn.Parameter, sid: str | None, sl, path: Path, key: str,
                source_offset: int = 0, expert: int | None = None) -> None:
    """This rank's rows [start, end) of the shard, which starts `source_offset` rows into the
    checkpoint tensor (a fused one's later shards); with `expert`, the tensor is that expert's
    alone and fills its slice of the stacked parameter (whose dim 0 is the experts)."""
    dim, start, end, offset = param.shards[sid]
    dest = param.data
    if expert is not None:
        dest, dim = dest[expert], dim - 1
    start, end = start + source_offset, end + source_offset
    full = sl.get_shape()
    expect = list(dest.shape)
    expect[dim] = full[dim] if dim < len(full) else -1
    if len(full) != dest.dim() or [f for i, f in enumerate(full) if i != dim] != \
            [e for i, e in enumerate(expect) if i != dim] or end > full[dim]:
        raise ModelLoadError(f"{path}: tensor {key!r} has shape {list(full)}, incompatible with "
                             f"the config (this rank needs rows [{start}, {end}) of dim {dim})")
    index = tuple([slice(None)] * dim + [slice(start, end)])
    dest.narrow(dim, offset, end - start).copy_(sl[index])
