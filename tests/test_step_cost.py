"""Speculation's step costs measured at warmup (backend/engine/speculation/step_cost.py): verify-shaped steps,
a table the speculator then uses, no new shapes after ready."""
from __future__ import annotations

import numpy as np

from backend import LLM
from backend.engine.speculation import step_cost
from backend.engine.buckets import BucketPlan
from backend.engine.kv_manager import SCRATCH_BLOCK
from backend.engine.sampling.sampling_params import SamplingParams


def test_a_verify_step_is_one_sequences_rows_padded_to_its_bucket():
    plan = BucketPlan(decode_sizes=(1, 2, 4, 8), token_sizes=(16,))
    step = step_cost.verify_step(3, context=20, num_blocks=6, block_size=8, plan=plan)
    assert step.num_tokens == 4 and list(step.logits_indices) == [0, 1, 2]
    assert list(step.positions[:3]) == [20, 21, 22]
    table = step.decode_block_tables
    assert table.shape == (4, 3) and SCRATCH_BLOCK not in table[:3]
    assert (table[:3] == table[0]).all() and (table[3] == SCRATCH_BLOCK).all()
    assert list(step.decode_context_lens) == [21, 22, 23, 1]  # row i sees up to its position
    # each row's K/V slot is its position's place in the sequence's table
    for row in range(3):
        pos = step.positions[row]
        assert step.slot_mapping[row] == table[row, pos // 8] * 8 + pos % 8
    assert step.slot_mapping[3] == SCRATCH_BLOCK * 8


def test_measure_times_each_row_count_and_keeps_the_table_non_decreasing(monkeypatch):
    # a clock that advances by what each step "costs": 1, then 1.5, 1.4 (noise), 2 per rows
    cost = {1: 1.0, 2: 1.5, 3: 1.4, 4: 2.0}
    clock = [0.0]
    monkeypatch.setattr(step_cost.time, "perf_counter", lambda: clock[0])
    seen = []

    def run_model(step):
        rows = len(step.logits_indices)
        seen.append(rows)
        assert step.argmax_only  # greedy verify rows, as measure's default says
        clock[0] += cost[rows]

    table = step_cost.measure(run_model, 4, num_blocks=40, block_size=8, rounds=3)
    assert table == (1.0, 1.5, 1.5, 2.0)
    assert sorted(seen[1:]) == sorted([1, 2, 3, 4] * 3)  # after one untimed first step
    assert seen[1:5] == [1, 2, 3, 4] and seen[5:9] == [4, 3, 2, 1]  # rounds alternate


def test_the_engine_hands_the_speculator_this_machines_table(tiny_text_model):
    kw = dict(model=str(tiny_text_model), num_kv_blocks=64, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=128)
    with LLM(**kw, speculative_ngram=3, speculative_ngram_match=2) as llm:
        spec = llm.engine.speculator
        table = spec.cost.table
        assert len(table) == spec.max_rows and table[0] == 1.0
        assert all(b >= a for a, b in zip(table, table[1:]))
        prompt = [int(t) for t in np.tile(np.arange(5, 17), 4)]
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert llm.stats["cold_path"] == {}  # the measured steps were warm shapes
    with LLM(**kw, warmup=False) as plain:
        assert plain.engine.speculator is None


def test_a_long_context_is_cut_to_what_the_pool_holds():
    tables = []
    steps = []
    step_cost.measure(steps.append, 3, num_blocks=6, block_size=8, context=10_000, rounds=1,
                      argmax_only=False)
    assert not any(step.argmax_only for step in steps)  # where the engine cannot screen
    tables = [step.decode_block_tables for step in steps]
    for t in tables:  # blocks 1-5 only: the pool has 6, block 0 is the scratch block
        assert t.min() >= 1 and t.max() <= 5 and t.shape[1] <= 5
