"""What a decode step of r rows costs on this machine, measured at warmup for speculation's policy.

Speculative decoding (speculation.py) weighs each draft token against what its verify row adds
to the step (StepCost: a step of r rows in one-row steps). That depends on the CPU more than on
anything else: where a core's multiply-adds are cheap next to its memory bandwidth the first
rows ride under the weight read, elsewhere each row costs more: the second row of a step cost
roughly two to three times as much (in one-row steps) on a CPU whose AVX-512 runs on 256-bit
units as on one with full-width units. A table from one CPU drafts too long on the other, so
the engine times verify-shaped steps before it reports ready (the shapes are warm by then:
this compiles nothing; about a second on 2 cores) and hands the speculator this machine's
table. It helped free-form chat and left grounded prompts within drift (`python -m client
bench speculation`; docs/decisions.md, "Draft sources and lengths").

A verify step is one sequence's rows over one block table, row i seeing the cache up to its own
position (step_inputs.build_step_inputs), padded to its decode bucket as the engine pads it.
Rounds alternate the row counts so the VM's drift lands on all of them; the median of the
rounds is kept, made non-decreasing (a step never costs less for more rows).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from backend.engine.buckets import BucketPlan
from backend.engine.sampling.sampling_params import SamplingParams
from backend.engine.sequence import Sequence
from backend.engine.step_inputs import StepInputs, build_step_inputs

log = logging.getLogger("backend.engine")

CONTEXT = 512  # tokens of context the measured steps attend to (speculation's prompts: 200-700)
ROUNDS = 9


def verify_step(rows: int, context: int, num_blocks: int, block_size: int,
                plan: BucketPlan | None = None) -> StepInputs:
    """`rows` verify rows of one sequence of `context` tokens, built as the engine builds them
    (step_inputs.build_step_inputs: a decode with rows - 1 drafts, padded to its bucket); its
    blocks cycle over the pool, never the scratch block: their contents do not matter here."""
    greedy = SamplingParams(temperature=0.0)
    seq = Sequence("step-cost", [0] * (context + 1), context + 1, greedy, 0)
    seq.num_computed_tokens = context
    seq.block_table = [1 + b % (num_blocks - 1) for b in range(-(-(context + rows) // block_size))]
    seq.draft_token_ids = [0] * (rows - 1)
    return build_step_inputs([(seq, rows)], block_size, plan)[0]


@torch.inference_mode()
def measure(run_model, max_rows: int, num_blocks: int, block_size: int,
            plan: BucketPlan | None = None, context: int = CONTEXT, rounds: int = ROUNDS,
            argmax_only: bool = True) -> tuple[float, ...]:
    """Cost of a verify step of 1..max_rows rows in one-row steps (table[r - 1]), timing
    `run_model(step)` (the engine's: every TP rank) `rounds` times per row count; argmax_only
    as the engine's greedy steps have it (the screened head where every rank screens)."""
    context = max(1, min(context, (num_blocks - 1) * block_size - max_rows))
    steps = [verify_step(r, context, num_blocks, block_size, plan) for r in range(1, max_rows + 1)]
    for step in steps:
        step.argmax_only = argmax_only
    run_model(steps[0])  # the first call after warmup's last bucket pays for cold caches
    seconds = [[] for _ in steps]
    for k in range(rounds):
        order = range(len(steps)) if k % 2 == 0 else reversed(range(len(steps)))
        for i in order:
            t0 = time.perf_counter()
            run_model(steps[i])
            seconds[i].append(time.perf_counter() - t0)
    medians = [float(np.median(s)) for s in seconds]
    table = [1.0]
    for m in medians[1:]:
        table.append(max(table[-1], m / medians[0]))
    return tuple(round(c, 3) for c in table)


def measure_engine(engine) -> tuple[float, ...]:
    """measure() on an engine's own model, pool and buckets, up to its speculator's rows."""
    t0 = time.perf_counter()
    table = measure(engine.run_model, engine.speculator.max_rows, engine.kv.num_blocks,
                    engine.kv.block_size, engine.plan, argmax_only=engine._screens_greedy)
    log.info("speculation: verify steps of 1-%d rows cost %s one-row steps here (%.1fs)",
             len(table), ", ".join(f"{c:.2f}" for c in table), time.perf_counter() - t0)
    return table
