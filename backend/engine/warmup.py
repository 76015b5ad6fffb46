"""Runs every bucket of the plan through a step (all TP ranks, then the sampler) before the
engine reports ready, so the first real request pays for nothing the tenth does not.

Decode buckets run whole (the fused stack binds each layer on its first step), and so does every
bucket with LoRA adapters' rows. Other buckets with a prompt chunk run their first WARM_LAYERS
layers (more where a family has layer kinds: warm_layers), then the norm, head and sampler:
every layer of a kind runs the same shapes through the same code,
so the GEMM libraries' per-shape kernels, the attention's and the sampler's first calls are all
met there, and the largest buckets, most of a whole-model warmup's time, cost a fraction of it
(docs/decisions.md, "Warmup runs prompt buckets through two layers")."""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch

from backend.engine.kv_manager import SCRATCH_BLOCK
from backend.engine.sampling.sampling_params import SamplingParams
from backend.engine.sequence import Sequence
from backend.engine.step_inputs import StepInputs

log = logging.getLogger("backend.engine")

# The first layer adds no residual; the second is every later layer's code path.
WARM_LAYERS = 2


def warm_layers(layer_windows: tuple[int, ...], moe_layers: tuple[int, ...] = ()) -> int:
    """How many first layers prompt buckets run through: WARM_LAYERS, or through the first
    layer of each kind where layers differ (windowed and global: Gemma 3's first global layer
    is its sixth; dense and mixture-of-experts MLPs: Qwen3-MoE's decoder_sparse_step), so every
    kind's attention and MLP meet their shapes here."""
    first = {}
    for i, window in enumerate(layer_windows):
        first.setdefault((window > 0, i in moe_layers), i)
    return max(WARM_LAYERS, max(first.values(), default=0) + 1)

# Exercise every sampler path: greedy, and random with every filter and penalty on.
_PARAMS = (SamplingParams(temperature=0.0),
           SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=0,
                          repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1))


def decode_step(rows: int) -> StepInputs:
    """`rows` decode rows that all attend to the scratch block."""
    z = np.zeros(rows, dtype=np.int64)
    return StepInputs(z, z, z + SCRATCH_BLOCK, np.arange(rows),
                      decode_block_tables=np.full((rows, 1), SCRATCH_BLOCK),
                      decode_context_lens=np.ones(rows, dtype=np.int64))


def mixed_step(tokens: int, num_blocks: int, block_size: int, max_len: int,
               max_rows: int = 9) -> StepInputs:
    """A few decode rows plus one prompt chunk filling the rest of `tokens`, sampling at most
    `max_rows` rows (max_num_seqs: a real step never samples more, and the TP logits gather is
    sized for it). The chunk's blocks cycle over the (still empty) pool: their contents do not
    matter, their shapes do."""
    d = min(8, tokens // 2, max_rows - 1)
    n = tokens - d
    pos = np.arange(n) % max_len
    table = 1 + np.arange(-(-n // block_size)) % num_blocks
    slots = table[np.arange(n) // block_size] * block_size + np.arange(n) % block_size
    step = decode_step(d) if d else StepInputs(*(np.zeros(0, dtype=np.int64),) * 4)
    return StepInputs(
        np.concatenate([step.input_ids, np.zeros(n, dtype=np.int64)]),
        np.concatenate([step.positions, pos]),
        np.concatenate([step.slot_mapping, slots]),
        np.concatenate([step.logits_indices, [tokens - 1]]).astype(np.int64),
        step.decode_block_tables, step.decode_context_lens,
        prefills=[(d, n, n, table.astype(np.int64))])


@torch.inference_mode()
def warm_up(engine) -> float:
    """Run the plan; returns seconds. Registers every shape it ran as warm."""
    t0 = time.perf_counter()
    plan, kv = engine.plan, engine.kv
    # Largest decode bucket first: on CUDA each one's graph is captured here, and the smaller
    # graphs then reuse the largest one's memory pool.
    steps = [decode_step(b) for b in reversed(plan.decode_sizes)]
    steps += [mixed_step(t, kv.num_blocks, kv.block_size, engine.max_model_len,
                         engine.config.max_num_seqs)
              for t in plan.token_sizes]
    # With LoRA adapters, each step again with their rows, through every layer: an adapter may
    # target any layers, each its own projections, so no first few layers hold every shape.
    lora_steps = engine.loras.warmup_steps(steps)
    cfg = engine.model_config
    limit = warm_layers(cfg.layer_windows, cfg.moe_layers)
    steps = [replace(s, layer_limit=limit) if s.prefills else s for s in steps] + lora_steps
    for i, step in enumerate(steps, 1):
        logits = engine.run_model(step)
        rows = [Sequence(f"warmup-{j}", [1, 2, 3], 2, _PARAMS[j % 2], j)
                for j in range(logits.shape[0])]
        engine.sampler(logits, rows)
        engine.warm_shapes.add(step.shape_key)
        if i % 8 == 0 or i == len(steps):
            log.info("warmup: %d/%d buckets, %d CUDA graphs captured, %.1fs", i, len(steps),
                     engine.runner.num_graph_captures, time.perf_counter() - t0)
    return time.perf_counter() - t0
