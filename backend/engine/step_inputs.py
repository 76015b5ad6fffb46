"""A scheduled step as plain arrays: built once on rank 0, pickled to every other rank.

Decodes (one token each, or 1 + drafts rows when verifying drafts: every such row samples) come
first, then prefill chunks; logits are taken only at the last token of each sequence whose chunk
reaches its end (it samples the next token). With a bucket
plan the step is padded to its bucket: a decode-only step gets extra decode rows that attend to
the scratch block, a step with prompt chunks gets trailing rows that attend to nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backend.engine.buckets import BucketPlan
from backend.engine.kv_manager import SCRATCH_BLOCK
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
    num_padding: int = 0  # trailing rows that attend to nothing (steps with prompt chunks)
    argmax_only: bool = False  # every sampling row takes its argmax only (Sampler.argmax_only)
    lora_ids: np.ndarray | None = None  # [T] each row's LoRA adapter (0: none); None: no row has one
    layer_limit: int | None = None  # warmup only: run the first n decoder layers (None: all)
    # [k, 2] (source, copy) cache blocks every rank copies before the forward: the last partial
    # block of a prompt forked into parallel samples (parallel_sampling.py); None: none
    block_copies: np.ndarray | None = None
    # rows whose final hidden states (after the last norm) embedding requests pool; None: none
    hidden_rows: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def shape_key(self) -> tuple[str, int]:
        """What warmup must have run for this step: the kind of step and its token count."""
        kind = "mixed" if self.prefills else "decode"
        return (kind if self.lora_ids is None else f"{kind}+lora", self.num_tokens)


def build_step_inputs(scheduled: list[tuple[Sequence, int]], block_size: int,
                      plan: BucketPlan | None = None
                      ) -> tuple[StepInputs, list[Sequence], list[tuple[Sequence, int, int]]]:
    """The step's arrays; the sequences that sample (in logits order); and the embedding
    requests' pooled rows (sequence, first position, rows), in hidden_rows order."""
    # a decode with drafts runs as 1 + drafts decode rows of the same sequence (speculation.py)
    decodes = [(s, n) for s, n in scheduled if n == 1 or s.draft_token_ids]
    prefills = [(s, n) for s, n in scheduled if n > 1 and not s.draft_token_ids]
    lora = any(s.lora_id for s, _ in scheduled)
    if lora:  # each adapter's rows together: its group is a slice (lora_layers.row_groups)
        decodes.sort(key=lambda sn: sn[0].lora_id)
        prefills.sort(key=lambda sn: sn[0].lora_id)
    rows = sum(n for _, n in decodes)
    scratch = SCRATCH_BLOCK * block_size
    pad_decodes = plan.decode_bucket(rows) - rows if plan and not prefills else 0
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_idx: list[int] = []
    sampling: list[Sequence] = []
    pooled: list[tuple[Sequence, int, int]] = []
    hidden_rows: list[int] = []
    chunks = []
    for seq, n in decodes + prefills:
        start, c0, table, draft = len(ids), seq.num_computed_tokens, seq.block_table, \
            seq.draft_token_ids
        ids.extend(seq.token_ids[c0:c0 + n] if not draft else seq.token_ids[c0:] + draft)
        positions.extend(range(c0, c0 + n))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c0, c0 + n))
        if draft:  # every row samples: the model's token after each draft prefix
            sampling.append(seq)
            logits_idx.extend(range(start, start + n))
            continue
        if n > 1:
            chunks.append((start, n, c0 + n, np.asarray(table, dtype=np.int64)))
        if seq.embedding is not None:
            first, k = seq.embedding.rows(c0, n, seq.num_tokens)
            if k or c0 + n == seq.num_tokens:  # (its last chunk ends it, rows or not)
                pooled.append((seq, first, k))
                hidden_rows.extend(range(start + first - c0, start + first - c0 + k))
        elif c0 + n == seq.num_tokens:
            sampling.append(seq)
            logits_idx.append(len(ids) - 1)
    _pad(ids, positions, slots, pad_decodes, scratch)  # decode-only: extra rows at the end
    num_padding = plan.token_bucket(len(ids)) - len(ids) if plan and prefills else 0
    _pad(ids, positions, slots, num_padding, scratch)
    inputs = StepInputs(np.asarray(ids, dtype=np.int64), np.asarray(positions, dtype=np.int64),
                        np.asarray(slots, dtype=np.int64),
                        np.asarray(logits_idx, dtype=np.int64), prefills=chunks,
                        num_padding=num_padding)
    if hidden_rows:
        inputs.hidden_rows = np.asarray(hidden_rows, dtype=np.int64)
    if lora:  # padding rows (at the end) run with none
        lora_ids = np.zeros(len(ids), dtype=np.int64)
        lora_ids[:sum(n for _, n in scheduled)] = np.concatenate(
            [np.full(n, s.lora_id, dtype=np.int64) for s, n in decodes + prefills])
        inputs.lora_ids = lora_ids
    if decodes or pad_decodes:
        width = max([len(s.block_table) for s, _ in decodes] + [1])
        tables = np.full((rows + pad_decodes, width), SCRATCH_BLOCK, dtype=np.int64)
        lens = np.ones(rows + pad_decodes, dtype=np.int64)  # padding rows see the scratch slot
        i = 0
        for s, n in decodes:  # a draft row sees the cache up to its own position
            tables[i:i + n, :len(s.block_table)] = s.block_table
            lens[i:i + n] = np.arange(s.num_computed_tokens + 1, s.num_computed_tokens + n + 1)
            i += n
        inputs.decode_block_tables, inputs.decode_context_lens = tables, lens
    return inputs, sampling, pooled


def _pad(ids: list[int], positions: list[int], slots: list[int], n: int, slot: int) -> None:
    ids.extend([0] * n)
    positions.extend([0] * n)
    slots.extend([slot] * n)
