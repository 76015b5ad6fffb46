"""The Llama-shaped decoder over a paged KV cache, for every family backend/model/family.py
describes: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norms), Gemma 2 and 3 (GeGLU,
sandwich norms, soft caps, local/global layers), Phi-3 (fused checkpoint tensors, partial
rotary), Mixtral, Qwen3-MoE and OLMoE (experts: moe.py). What a family changes is read from its
ModelConfig, not from model_type here."""
from __future__ import annotations

from itertools import islice
from types import ModuleType

import torch
from torch import nn

from backend.model.attention import Attention
from tpllm_kernels.metadata import AttentionMetadata
from backend.model import host_memory
from backend.model.config import ModelConfig
from backend.model.greedy_head import GreedyPicks
from backend.model.layers import (ColumnParallelLinear, DirectModule, ParallelLMHead,
                                  RMSNorm, RowParallelLinear, VocabParallelEmbedding)
from backend.model.moe import MoE
from backend.parallel.context import ParallelContext
from backend.parallel.partition import split_range
from tpllm_kernels import reference, select_ops

class MLP(DirectModule):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 ops: ModuleType = reference):
        super().__init__()
        self.ops = ops
        # An even split, whatever the head split: the MLP sits between two collectives, so it
        # must balance on its own. (Shifting rows to the rank with fewer heads, to even out the
        # whole layer's bytes, made each rank wait at every other collective: `python -m
        # client bench tp`; docs/decisions.md, "The MLP splits evenly whatever the head split".)
        rows = split_range(cfg.intermediate_size, ctx.rank, ctx.world_size)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, {"gate": rows, "up": rows},
                                                 bias=cfg.mlp_bias, dtype=dtype, ops=ops)
        self.down_proj = RowParallelLinear(rows, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype,
                                           ctx=ctx, ops=ops)
        self.gelu = cfg.hidden_act == "gelu_tanh"  # GeGLU (Gemma), else SwiGLU
        self.act = ops.gelu_tanh_mul if self.gelu else ops.silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(DirectModule):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 ops: ModuleType = reference, index: int = 0):
        super().__init__()
        self.ops = ops
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype, ops)
        self.self_attn = Attention(cfg, ctx, dtype, ops, index)
        # the pre-MLP norm (Llama's name for it; Gemma's pre_feedforward_layernorm)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, ops)
        self.mlp = (MoE if index in cfg.moe_layers else MLP)(cfg, ctx, dtype, ops)
        # Gemma's sandwich: norms of the attention's and the MLP's outputs, before the residual
        self.attn_out_norm = self.mlp_out_norm = None
        if cfg.family.sandwich_norms:
            self.attn_out_norm = RMSNorm(h, eps, dtype, ops)
            self.mlp_out_norm = RMSNorm(h, eps, dtype, ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the layer's output before its residual add (the next norm adds it)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, meta, kv_cache)
        if self.attn_out_norm is not None:
            x = self.attn_out_norm(x)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.mlp_out_norm is not None:
            x = self.mlp_out_norm(x)
        return x, residual

    def forward_decode(self, x: torch.Tensor, residual: torch.Tensor | None,
                       meta: AttentionMetadata, bound, lora_ids: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() for a decode-only step with ops.FUSED_DECODE and this layer bound
        (bind_decode): each half of the layer is one kernel call, the collectives stay between
        them. Same arithmetic, same bits. lora_ids: each row's LoRA adapter (0: none), None when
        no row has one."""
        ops, o_proj, down_proj = self.ops, self.self_attn.o_proj, self.mlp.down_proj
        add = residual is not None
        if not add:
            residual, x = x, self.input_layernorm(x)
        # with shared memory, each half ends with its all-reduce (no return to Python between)
        coll = o_proj.ctx.fused_collective(x.numel(), x.dtype)
        y, residual, arrived, s = ops.decode_attention_half(
            bound, x, residual, add, meta.cos, meta.sin, meta.slot_mapping, meta.decode, coll,
            lora_ids, meta.local_cos, meta.local_sin)
        x = o_proj.finish(y, arrived, s, coll)
        if self.attn_out_norm is not None:
            x = self.attn_out_norm(x)
        coll = down_proj.ctx.fused_collective(x.numel(), x.dtype)
        y, residual, arrived, s = ops.decode_mlp_half(bound, x, residual, coll, lora_ids)
        x = down_proj.finish(y, arrived, s, coll)
        if self.mlp_out_norm is not None:
            x = self.mlp_out_norm(x)
        return x, residual

    def bind_decode(self, kv_cache: tuple[torch.Tensor, torch.Tensor]):
        """This layer's weights, KV cache and LoRA adapters (where attached: each projection's
        stacked ones, lora_layers.LoraSlot) bound for the fused decode kernels."""
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        lora = [None if m.lora is None else m.lora.stacked for m in linears]
        return self.ops.decode_layer(
            norm1.weight, norm1.eps, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.num_q,
            attn.num_kv, kv_cache[0], kv_cache[1], attn.scale, attn.kv_index, attn.o_proj.weight,
            attn.o_proj.bias, norm2.weight, norm2.eps, mlp.gate_up_proj.weight,
            mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias, lora,
            family=self.family_parts())

    @property
    def fusable(self) -> bool:
        """Whether the fused decode kernels compute this layer: they have no experts and
        normalize q and k per head only."""
        return isinstance(self.mlp, MLP) and self.self_attn.qk_whole is None

    def family_parts(self) -> dict:
        """What this layer adds to Llama's for the fused decode kernels (decode_layer): q/k norm
        weights, the sandwich's out-norm weights, GeGLU, the window, the soft cap, the local
        rope; empty for a Llama-shaped layer."""
        attn, parts = self.self_attn, {}
        if attn.q_norm is not None:
            parts["q_norm"], parts["k_norm"] = attn.q_norm.weight, attn.k_norm.weight
        if self.attn_out_norm is not None:
            parts["attn_out_norm"] = self.attn_out_norm.weight
            parts["mlp_out_norm"] = self.mlp_out_norm.weight
        if self.mlp.gelu:
            parts["gelu"] = True
        parts.update(attn.options())
        if attn.local_rope:
            parts["local_rope"] = True
        return parts


class LlamaForCausalLM(DirectModule):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 ops: ModuleType | None = None):
        super().__init__()
        self.cfg = cfg
        # The one place the model picks its kernels: by the device its parameters are created
        # on (torch's default device) unless given; TPLLM_KERNELS overrides
        # (tpllm_kernels/__init__).
        self.ops = ops = ops if ops is not None else select_ops(torch.get_default_device())
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, ctx)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ctx, dtype, ops, i)
                                    for i in range(cfg.num_layers))
        # Gemma scales its embeddings by sqrt(hidden), the factor rounded to the dtype first
        self.embed_scale = (torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).to(dtype)
                            if cfg.family.embed_scale else None)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        # decode-only steps may run each layer as two fused kernel calls (DecoderLayer.forward_decode)
        # where the kernels compute every layer (no experts: else every step runs modular)
        self.fused_decode = bool(getattr(ops, "FUSED_DECODE", False)) and all(
            layer.fusable for layer in self.layers) and (
            getattr(ops, "FUSED_FAMILY_PARTS", False)
            or not any(layer.family_parts() for layer in self.layers))
        # ...and with one rank, all layers as one call (ops.decode_stack); bound lazily, per KV cache
        self.fused_stack = self.fused_decode and ctx.world_size == 1
        self._bound: tuple[int, list] | None = None
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, ctx, tied=tied,
                                      ops=ops, softcap=cfg.final_softcap)
        # LoRA adapters (lora_layers.attach_adapters): the step's adapter rows, read by the slots
        self.lora_rows = None
        # steps that ran on the fused decode kernels, and those with adapter rows (tests check
        # that a family's and LoRA's decode steps do not fall back to the modular path)
        self.fused_steps = self.fused_lora_steps = 0
        self.generates = True  # False: an embedding checkpoint without an lm_head (loader.py)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor | None, argmax_only: bool = False,
                lora: list | None = None, layer_limit: int | None = None,
                hidden_rows: torch.Tensor | None = None
                ) -> torch.Tensor | GreedyPicks | None | tuple:
        """Runs the flat batch; returns float32 logits for the rows in `logits_indices` only
        (ascending: the last token of each sequence that samples this step), or [0, V] when
        none.
        Under tensor parallelism only rank 0 gets logits; the others get None.
        argmax_only: every such row only takes its argmax; with greedy screening on
        (lm_head.enable_greedy_screening) the rows' tokens and exact logits come back as
        GreedyPicks instead (backend/model/greedy_head.py).
        lora: the step's LoRA adapter rows (lora_layers.row_groups: StepLora); a decode step
        with them runs fused where the kernels add the deltas (ops.FUSED_LORA: float32), else the
        modular path.
        layer_limit: run only the first n decoder layers, then the norm and head: warmup's steps
        with prompt chunks (engine/warmup.py). Every layer runs the same shapes through the same
        code, so the first two (the first has no residual to add) meet all a step's shapes at a
        fraction of its time; a decode-only step, which runs fused, takes none.
        hidden_rows: rows whose final hidden states (after the last norm: transformers'
        last_hidden_state) embedding requests pool; given, the result is (logits, hidden)."""
        if self.lora_rows is not None:
            self.lora_rows.set(lora)
        elif lora:
            raise ValueError("this model has no LoRA adapters attached")
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if (begin := getattr(self.ops, "begin_forward", None)) is not None:
            begin(x.shape[0], x.dtype)  # where this pass's kernel loops run (CPU)
        residual = None
        ids = lora.ids if lora else None
        if not self._fused_step(x, meta, bool(lora)):
            for layer, kv in zip(islice(self.layers, layer_limit), kv_caches):
                x, residual = layer(x, residual, meta, kv)
        elif layer_limit is not None:
            raise ValueError("layer_limit is for steps with prompt chunks, not fused decode steps")
        else:
            self.fused_steps += 1
            self.fused_lora_steps += ids is not None
            x, residual = self._fused_layers(x, meta, kv_caches, ids)
        if hidden_rows is not None:  # copies: the logits' norm below may work in place
            hidden, _ = self.norm(x.index_select(0, hidden_rows),
                                  residual.index_select(0, hidden_rows))
            return self._logits(x, residual, logits_indices, argmax_only), hidden.float()
        return self._logits(x, residual, logits_indices, argmax_only)

    def _logits(self, x: torch.Tensor, residual: torch.Tensor,
                logits_indices: torch.Tensor | None, argmax_only: bool
                ) -> torch.Tensor | GreedyPicks | None:
        if logits_indices is None or logits_indices.numel() == 0:
            return x.new_empty(0, self.cfg.vocab_size, dtype=torch.float32)
        # Norm and project only the rows that sample: prefill rows need no logits. The indices
        # ascend (build_step_inputs), so as many as there are rows are every row, in order: a
        # decode step's, which skips two copies.
        if logits_indices.numel() != x.shape[0]:
            x = x.index_select(0, logits_indices)
            residual = residual.index_select(0, logits_indices)
        x, _ = self.norm(x, residual)
        if argmax_only and self.lm_head.screen is not None:
            return self.lm_head.argmax_logits(x)
        return self.lm_head(x)

    def _fused_layers(self, x: torch.Tensor, meta: AttentionMetadata,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      lora_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer of a decode-only step on the fused kernels: all in one call (one
        rank), in one call per rank with the all-reduces inside (TP over shared memory), or two
        calls per layer."""
        bound = self._bound_layers(kv_caches)
        if self.fused_stack:
            residual, x = x, self.layers[0].input_layernorm(x)
            return self.ops.decode_stack(bound, x, residual, False, meta.cos, meta.sin,
                                         meta.slot_mapping, meta.decode, lora_ids,
                                         meta.local_cos, meta.local_sin)
        if (stacked := self._tp_decode_stack(x, meta, bound, lora_ids)) is not None:
            return stacked
        residual = None
        for layer, b in zip(self.layers, bound):
            x, residual = layer.forward_decode(x, residual, meta, b, lora_ids)
        return x, residual

    def _tp_decode_stack(self, x: torch.Tensor, meta: AttentionMetadata, bound: list,
                         lora_ids: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A tensor-parallel rank's decode step through every layer in C++ with the all-reduces
        inside (ops.decode_stack_tp), resumed after any all-reduce a peer was late for; None when
        the communicator cannot (not shared memory, batch over the slot)."""
        ctx = self.layers[0].mlp.down_proj.ctx
        stack = getattr(self.ops, "decode_stack_tp", None)
        coll = ctx.fused_stack(x.numel(), x.dtype) if stack is not None else None
        if coll is None:
            return None
        residual, x = x, self.layers[0].input_layernorm(x)
        start, add = 0, False
        while start < 2 * len(bound):
            x, residual, ran, arrived, seconds = stack(
                bound, x, residual, add, meta.cos, meta.sin, meta.slot_mapping, meta.decode,
                start, coll, lora_ids, meta.local_cos, meta.local_sin)
            x = ctx.stack_done(x, ran, arrived, seconds)
            start, add = start + ran, True
            if not arrived:  # the late half's bias and out norm, after its sum (as the halves)
                layer = self.layers[(start - 1) // 2]
                attention = start % 2 == 1
                bias = (layer.self_attn.o_proj if attention else layer.mlp.down_proj).bias
                x = x if bias is None else x + bias
                norm = layer.attn_out_norm if attention else layer.mlp_out_norm
                x = x if norm is None else norm(x)
                coll = ctx.fused_stack(x.numel(), x.dtype)
        return x, residual

    def pack_linear_weights(self, rows: int) -> int:
        """A packed copy of every linear's weight (lm_head included) for inputs of exactly `rows`
        rows, where the kernels keep one (ops.pack_linear_weight); returns the copies' bytes."""
        pack = getattr(self.ops, "pack_linear_weight", None)
        if pack is None or rows < 1:
            return 0
        kinds = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
        return sum(pack(m.weight, rows) for m in self.modules() if isinstance(m, kinds))

    def keep_block_copies(self) -> int:
        """An exact block copy beside every linear's weight (lm_head included) that has one,
        where the kernels read them (ops.keep_block_copy; tpllm_kernels/cpu_blocks.py); returns
        their bytes. The copies then move, in the order a step reads them, into one huge-page
        arena, as the weights sit in: a batch-1 decode step streams them all (docs/decisions.md,
        "The block copies sit on huge pages")."""
        keep = getattr(self.ops, "keep_block_copy", None)
        if keep is None:
            return 0
        kinds = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
        weights = list({id(m.weight): m.weight for m in self.modules()
                        if isinstance(m, kinds)}.values())
        kept = sum(keep(w) for w in weights)
        copied = [w for w in weights if getattr(w, "block_copy", None) is not None]
        if copied:  # CPU float32 weights only (cpu_blocks.py)
            moved = iter(host_memory.copy_to_arena([t for w in copied for t in w.block_copy[1:]]))
            for w in copied:
                w.block_copy = (w.block_copy[0], next(moved), next(moved))
        return kept

    def rebind_decode(self) -> None:
        """Bind the fused decode layers again at the next step (their LoRA adapters changed)."""
        self._bound = None

    def _bound_layers(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list:
        key = kv_caches[0][0].data_ptr()
        if self._bound is None or self._bound[0] != key:
            self._bound = (key, [layer.bind_decode(kv) for layer, kv in zip(self.layers, kv_caches)])
        return self._bound[1]

    def _fused_step(self, x: torch.Tensor, meta: AttentionMetadata, lora: bool = False) -> bool:
        if not (self.fused_decode and not meta.prefills and meta.decode is not None):
            return False
        if lora:  # the deltas' kernel is float32's (lora_delta_), at the GEMV's rows
            return (getattr(self.ops, "FUSED_LORA", False) and x.dtype == torch.float32
                    and x.shape[0] <= self.ops.SMALL_M)
        if x.dtype == torch.float32:
            return x.shape[0] <= self.ops.SMALL_M
        # bf16: one rank (the collectives inside the fused stack are float32's), the rows the
        # bf16 GEMV takes; through Python, the calls were over a quarter of a bf16 step
        return (x.dtype == torch.bfloat16 and self.layers[0].mlp.down_proj.ctx.world_size == 1
                and x.shape[0] <= getattr(self.ops, "FUSED_DECODE_BF16_ROWS", 0))
