"""A scheduled step as plain arrays: built once on rank 0, pickled to every other rank.

Decodes (one token each) come first, then prefill chunks; logits are taken only at the last
token of each sequence whose chunk reaches its end (it samples the next token).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backend.engine.sequence import Sequence


@dataclass
class StepInputs:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] cache slot of each new token
    logits_indices: np.ndarray  # rows whose logits are needed, in sampling order
    decode_block_tables: np.ndarray | None = None  # [num_decodes, max_blocks], 0-padded
    decode_context_lens: np.ndarray | None = None  # [num_decodes]
    prefills: list[tuple[int, int, int, np.ndarray]] = field(default_factory=list)  # start, len, ctx, blocks

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def build_step_inputs(scheduled: list[tuple[Sequence, int]],
                      block_size: int) -> tuple[StepInputs, list[Sequence]]:
    decodes = [(s, n) for s, n in scheduled if n == 1]
    prefills = [(s, n) for s, n in scheduled if n > 1]
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_idx: list[int] = []
    sampling: list[Sequence] = []
    chunks = []
    for seq, n in decodes + prefills:
        start, c0, table = len(ids), seq.num_computed_tokens, seq.block_table
        ids.extend(seq.token_ids[c0:c0 + n])
        positions.extend(range(c0, c0 + n))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c0, c0 + n))
        if n > 1:
            chunks.append((start, n, c0 + n, np.asarray(table, dtype=np.int64)))
        if c0 + n == seq.num_tokens:
            sampling.append(seq)
            logits_idx.append(len(ids) - 1)
    inputs = StepInputs(np.asarray(ids, dtype=np.int64), np.asarray(positions, dtype=np.int64),
                        np.asarray(slots, dtype=np.int64),
                        np.asarray(logits_idx, dtype=np.int64), prefills=chunks)
    if decodes:
        width = max(len(s.block_table) for s, _ in decodes)
        tables = np.zeros((len(decodes), width), dtype=np.int64)
        for i, (s, _) in enumerate(decodes):
            tables[i, :len(s.block_table)] = s.block_table
        inputs.decode_block_tables = tables
        inputs.decode_context_lens = np.asarray([s.num_computed_tokens + 1 for s, _ in decodes],
                                                dtype=np.int64)
    return inputs, sampling
