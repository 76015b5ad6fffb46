"""Decode-only steps from static buffers, one per batch bucket
(tpllm_kernels.cuda_graphs.GraphRunner): captured CUDA graphs on CUDA, the same buffers called
eagerly elsewhere (tests).

What makes the step capturable: every input has a fixed shape per bucket (block tables are
widened to the longest context the engine serves, max_model_len), and the attention reads each
row's length from the device (the Triton kernel's own masking; the torch path masks with a
fixed upper bound, DecodeBatch.bounded), so nothing reads a tensor on the host inside the graph.
Logits are computed for every row of the bucket and the step's rows copied out afterwards.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from backend.engine.device_inputs import DeviceInputs
from backend.engine.kv_manager import SCRATCH_BLOCK
from backend.engine.step_inputs import StepInputs
from backend.model.llama import LlamaForCausalLM
from backend.model.rotary import RotaryTables
from tpllm_kernels.cuda_graphs import GraphRunner, StaticInput
from tpllm_kernels.metadata import AttentionMetadata, DecodeBatch


class StepOwner(Protocol):
    """What a decode step needs from the rank's ModelRunner (model_runner.py), which owns the
    DecodeGraphs: named here so that this module does not import the runner's."""
    model: LlamaForCausalLM
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    rotary: RotaryTables
    inputs: DeviceInputs
    block_size: int
    max_model_len: int
    device: torch.device


class DecodeGraphs:
    def __init__(self, runner: StepOwner, buckets: Sequence[int], use_graphs: bool,
                 on_capture: Callable[[int], None] | None = None):
        self.runner = runner
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.use_graphs = use_graphs
        self.on_capture = on_capture
        bs = runner.block_size
        self.width = -(-runner.max_model_len // bs)  # blocks of the longest context served
        i64 = torch.int64
        # padding rows (if any) look like the engine's: token 0 at position 0, writing and
        # reading the one scratch slot
        specs = [StaticInput((), i64, 0), StaticInput((), i64, 0),
                 StaticInput((), i64, SCRATCH_BLOCK * bs),
                 StaticInput((self.width,), i64, SCRATCH_BLOCK), StaticInput((), i64, 1)]
        self._rows = torch.arange(self.buckets[-1], device=runner.device)
        self.graphs = GraphRunner(self._step, self.buckets, specs, runner.device,
                                  use_graphs=use_graphs, lazy=True, on_capture=on_capture)

    @property
    def num_captures(self) -> int:
        return self.graphs.num_captures

    def accepts(self, inputs: StepInputs) -> bool:
        """A decode-only step of a bucket's size whose block tables fit the static width, without
        LoRA rows (they run eagerly: a graph would fix the step's adapter groups)."""
        tables = inputs.decode_block_tables
        return (inputs.lora_ids is None and inputs.hidden_rows is None and not inputs.prefills and tables is not None and inputs.num_tokens in self.buckets
                and tables.shape[0] == inputs.num_tokens and tables.shape[1] <= self.width)

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        # the step's tables as they are: GraphRunner widens them on the device (no host copy
        # of max_model_len / block_size columns per row)
        ids, pos, slots, tab, lens, idx = self.runner.inputs.to_device(
            inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.decode_block_tables,
            inputs.decode_context_lens, inputs.logits_indices)
        out = self.graphs(ids, pos, slots, tab, lens)
        if out.dim() != 2 or out.dtype != torch.float32:  # a rank without logits (TP)
            return None
        # a copy: the graph's static output is overwritten by the next replay
        return out.index_select(0, idx)

    def _step(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
              tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        r = self.runner
        meta = AttentionMetadata(slot_mapping=slots, **r.rotary.lookup_all(pos))
        meta.decode = DecodeBatch(tables, lens, self.width * r.block_size, r.block_size,
                                  bounded=True)
        logits = r.model(ids, meta, r.kv_caches, self._rows[:ids.shape[0]])
        return ids if logits is None else logits  # other TP ranks: any tensor with b rows
