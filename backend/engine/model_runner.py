"""Runs one step of the model on this rank: owns the paged KV cache and the rotary tables."""
from __future__ import annotations

import torch

from backend.engine.step_inputs import StepInputs
from backend.model.llama import LlamaForCausalLM
from backend.model.rotary import RotaryTables
from kernels.metadata import AttentionMetadata, DecodeBatch, PrefillChunk


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 max_model_len: int, dtype: torch.dtype):
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.rotary = RotaryTables(cfg, max_model_len, dtype)
        attn = model.layers[0].self_attn
        shape = (num_blocks + 1, block_size, attn.num_kv, cfg.head_dim)  # + the scratch block
        # Allocated (and touched, so the OS commits it) once, at load.
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(cfg.num_layers)]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """Logits [len(logits_indices), V] on rank 0 (None on other ranks under TP)."""
        return self.model(torch.from_numpy(inputs.input_ids), self.metadata(inputs),
                          self.kv_caches, torch.from_numpy(inputs.logits_indices))

    def metadata(self, inputs: StepInputs) -> AttentionMetadata:
        cos, sin = self.rotary.lookup(torch.from_numpy(inputs.positions))
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(inputs.slot_mapping), cos=cos, sin=sin,
            prefills=[PrefillChunk(s, n, c, torch.from_numpy(t)) for s, n, c, t in inputs.prefills],
            num_padding=inputs.num_padding)
        if inputs.decode_block_tables is not None:
            lens = torch.from_numpy(inputs.decode_context_lens)
            meta.decode = DecodeBatch(torch.from_numpy(inputs.decode_block_tables), lens,
                                      int(lens.max()), self.block_size)
        return meta
