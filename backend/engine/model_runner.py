"""Runs one step of the model on this rank: owns the paged KV cache and the rotary tables, on the
rank's device, and (on CUDA) the decode step's CUDA graphs."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from backend.engine.decode_graphs import DecodeGraphs
from backend.engine.device_inputs import DeviceInputs
from backend.engine.step_inputs import StepInputs
from backend.model import host_memory
from backend.model.greedy_head import GreedyPicks
from backend.model.llama import LlamaForCausalLM
from backend.model.lora_layers import row_groups
from backend.model.rotary import RotaryTables
from tpllm_kernels.metadata import AttentionMetadata, DecodeBatch, PrefillChunk

log = logging.getLogger("backend.engine")


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 max_model_len: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 packed_rows: int = 0):
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rotary = RotaryTables(cfg, max_model_len, dtype, self.device)
        attn = model.layers[0].self_attn
        shape = (num_blocks + 1, block_size, attn.num_kv, cfg.head_dim)  # + the scratch block
        # Allocated (and touched, so the OS commits it) once, at load; on CPU in one huge-page
        # mapping like the weights (decode reads every cached token of every layer each step).
        if self.device.type == "cpu":
            flat = host_memory.zeros([shape] * (2 * cfg.num_layers), dtype)
            self.kv_caches = list(zip(flat[0::2], flat[1::2]))
        else:
            self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=self.device),
                               torch.zeros(shape, dtype=dtype, device=self.device))
                              for _ in range(cfg.num_layers)]
        self.inputs = DeviceInputs(self.device)
        self.packed_weight_bytes = self._pack_weights(packed_rows)
        self.block_copy_bytes = self._keep_block_copies()
        self.decode_graphs: DecodeGraphs | None = None
        self._cuda_index = self.device.index if self.device.type == "cuda" else None

    def _pack_weights(self, rows: int) -> int:
        """CPU: the full decode batch's GEMMs from packed weight copies (tpllm_kernels/cpu_ops.py),
        unless the copies would take over half the memory still available."""
        if self.device.type != "cpu" or rows < 1:
            return 0
        need = sum(p.numel() * p.element_size() for p in self.model.parameters())
        available = host_memory.available_bytes()
        if available is not None and need > available // 2:
            log.warning("not packing weights for %d-row batches: they would take %.2f of the "
                        "%.2f GiB available", rows, need / 2**30, available / 2**30)
            return 0
        return self.model.pack_linear_weights(rows)

    def _keep_block_copies(self) -> int:
        """CPU decode steps read weights from exact block copies where the float32 weights are
        Q4_1 / Q8_0 blocks (tpllm_kernels/cpu_blocks.py): same results, a sixth / a quarter of
        the bytes read, 19% / 28% more memory held."""
        if self.device.type != "cpu":
            return 0
        t0 = time.perf_counter()
        kept = self.model.keep_block_copies()
        if kept:
            log.info("decode reads exact block copies of the weights (%.1f MB, found in %.2f s)",
                     kept / 1e6, time.perf_counter() - t0)
        return kept

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def enable_decode_graphs(self, buckets: Sequence[int], use_graphs: bool,
                             on_capture: Callable[[int], None] | None = None) -> None:
        """Run decode-only steps of these batch sizes from static buffers: captured CUDA graphs
        with use_graphs (CUDA), else the same buffers called eagerly (tests the padding on CPU).
        Graphs are captured at each bucket's first step (the engine's warmup)."""
        self.decode_graphs = DecodeGraphs(self, buckets, use_graphs, on_capture)

    def reset_decode_graphs(self) -> None:
        """Drop captured graphs (they hold the old communicator after a TP group rebuild); the
        next step of each bucket captures again."""
        if self.decode_graphs is not None:
            g = self.decode_graphs
            self.decode_graphs = DecodeGraphs(self, g.buckets, g.use_graphs, g.on_capture)

    @property
    def num_graph_captures(self) -> int:
        return 0 if self.decode_graphs is None else self.decode_graphs.num_captures

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | GreedyPicks | None:
        """Logits [len(logits_indices), V] on rank 0 (None on other ranks under TP); an
        argmax_only step's GreedyPicks where the model screens its head."""
        if self._cuda_index is not None and torch.cuda.current_device() != self._cuda_index:
            torch.cuda.set_device(self._cuda_index)  # per thread: Triton launches on it
        if inputs.block_copies is not None:
            self.copy_blocks(inputs.block_copies)
        if self.decode_graphs is not None and self.decode_graphs.accepts(inputs):
            return self.decode_graphs.run(inputs)
        ids, idx, *rest = self.inputs.to_device(inputs.input_ids, inputs.logits_indices,
                                                *_meta_arrays(inputs))
        lora = None if inputs.lora_ids is None else row_groups(inputs.lora_ids, self.device)
        hidden = None if inputs.hidden_rows is None else torch.as_tensor(
            inputs.hidden_rows, device=self.device)
        return self.model(ids, self.metadata(inputs, rest), self.kv_caches, idx,
                          inputs.argmax_only, lora, inputs.layer_limit, hidden)

    def copy_blocks(self, pairs: np.ndarray) -> None:
        """Copy cache blocks pairs[:, 0] into pairs[:, 1], K and V of every layer (a forked
        prompt's last partial block: each sample writes its own tokens into its copy)."""
        src = torch.as_tensor(pairs[:, 0], device=self.device)
        dst = torch.as_tensor(pairs[:, 1], device=self.device)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    def metadata(self, inputs: StepInputs, tensors: list[torch.Tensor]) -> AttentionMetadata:
        """Attention inputs of a step from its _meta_arrays, already on the device."""
        positions, slot_mapping, *rest = tensors
        tables = rest[len(rest) - len(inputs.prefills):]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, **self.rotary.lookup_all(positions),
            prefills=[PrefillChunk(s, n, c, t) for (s, n, c, _), t in zip(inputs.prefills, tables)],
            num_padding=inputs.num_padding)
        if inputs.decode_block_tables is not None:  # longest context from the host: no sync
            meta.decode = DecodeBatch(rest[0], rest[1], int(inputs.decode_context_lens.max()),
                                      self.block_size)
        return meta


def _meta_arrays(inputs: StepInputs) -> list[np.ndarray]:
    """positions, slot mapping, [decode block tables, context lens], prefill block tables."""
    out = [inputs.positions, inputs.slot_mapping]
    if inputs.decode_block_tables is not None:
        out += [inputs.decode_block_tables, inputs.decode_context_lens]
    return out + [t for _, _, _, t in inputs.prefills]
