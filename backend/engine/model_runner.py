"""Turns a scheduled step into tensors, runs the model over the paged KV cache, returns logits."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.engine.sequence import Sequence
from backend.model.llama import LlamaForCausalLM
from backend.model.rotary import RotaryTables
from kernels.metadata import AttentionMetadata, DecodeBatch, PrefillChunk


@dataclass
class StepResult:
    logits: torch.Tensor  # [len(sampling), V] float32
    sampling: list[Sequence]  # sequences that produce a token this step, in logits row order


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 max_model_len: int, dtype: torch.dtype):
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.rotary = RotaryTables(cfg, max_model_len, dtype)
        attn = model.layers[0].self_attn
        shape = (num_blocks, block_size, attn.num_kv, cfg.head_dim)
        # Allocated (and touched, so the OS commits it) once, at load.
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(cfg.num_layers)]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def execute(self, scheduled: list[tuple[Sequence, int]]) -> StepResult:
        ids, meta, logits_idx, sampling = self.prepare(scheduled)
        logits = self.model(ids, meta, self.kv_caches, logits_idx)
        return StepResult(logits, sampling)

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        decodes = [(s, n) for s, n in scheduled if n == 1]
        prefills = [(s, n) for s, n in scheduled if n > 1]
        ids: list[int] = []
        positions: list[int] = []
        sampling: list[Sequence] = []
        logits_idx: list[int] = []
        chunks: list[PrefillChunk] = []
        for seq, n in decodes + prefills:
            start, c0 = len(ids), seq.num_computed_tokens
            ids.extend(seq.token_ids[c0:c0 + n])
            positions.extend(range(c0, c0 + n))
            if n > 1:
                chunks.append(PrefillChunk(start, n, c0 + n, torch.tensor(seq.block_table)))
            if c0 + n == seq.num_tokens:  # the chunk reaches the end: sample the next token
                sampling.append(seq)
                logits_idx.append(len(ids) - 1)
        pos = torch.tensor(positions)
        cos, sin = self.rotary.lookup(pos)
        slot_mapping = self._slots(decodes + prefills)
        meta = AttentionMetadata(slot_mapping=slot_mapping, cos=cos, sin=sin, prefills=chunks)
        if decodes:
            width = max(len(s.block_table) for s, _ in decodes)
            lens = [s.num_computed_tokens + 1 for s, _ in decodes]
            meta.decode = DecodeBatch(
                block_tables=torch.tensor(
                    [s.block_table + [0] * (width - len(s.block_table)) for s, _ in decodes]),
                context_lens=torch.tensor(lens), max_context=max(lens),
                block_size=self.block_size)
        return torch.tensor(ids), meta, torch.tensor(logits_idx, dtype=torch.long), sampling

    def _slots(self, ordered: list[tuple[Sequence, int]]) -> torch.Tensor:
        bs = self.block_size
        slots: list[int] = []
        for seq, n in ordered:
            table, c0 = seq.block_table, seq.num_computed_tokens
            slots.extend(table[p // bs] * bs + p % bs for p in range(c0, c0 + n))
        return torch.tensor(slots, dtype=torch.long)
