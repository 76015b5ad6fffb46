"""The mixture-of-experts MLP of Mixtral, Qwen3-MoE and OLMoE, on the modular torch path.

A router (replicated on every rank) scores the experts of each token; the token goes through
its top k, and its output is their outputs weighted by the router's probabilities. Each expert
is a gated MLP whose intermediate dim splits across TP ranks as the dense MLP's does (gate/up by
rows, down by columns), so the layer's output is still one all-reduce of partial sums.

The arithmetic is transformers' (its default grouped_mm experts): float32 softmax of the
router's logits, torch.topk, the top k weights renormalized where the family does
(Family.moe_norm_topk, config.json's norm_topk_prob) and cast to the model's dtype where it does
(Family.moe_weights_in_dtype); each expert's output times its weight, summed over the row's
experts in top-k order in float32 and rounded to the dtype once. A step's rows are grouped by
expert, one pair of matmuls per expert that has rows; a row's sum never mixes in another row's
values, so its bits do not depend on the batch beyond what its experts' GEMMs do.

The fused C++ decode stack has no experts: a model with an MoE layer runs every step here
(DecoderLayer.fusable).
"""
from __future__ import annotations

from types import ModuleType

import torch

from backend.model.config import ModelConfig
from backend.model.layers import DirectModule, sharded_param
from backend.parallel.context import ParallelContext
from backend.parallel.partition import split_range
from tpllm_kernels import reference


class Router(DirectModule):
    """The gate: [experts, hidden], whole on every rank (each rank routes every row itself,
    identically: its input is the same all-reduced hidden state)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: ModuleType):
        super().__init__()
        self.ops = ops
        e = cfg.num_experts
        self.weight = sharded_param((e, cfg.hidden_size), dtype, {None: (0, 0, e, 0)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight)


class Experts(DirectModule):
    """Every expert's weights stacked, as transformers holds them: gate_up_proj [E, 2 I, H]
    (this rank's gate rows, then its up rows) and down_proj [E, H, I] (this rank's columns).
    The parameters' `num_experts` tells the loader that a checkpoint's per-expert tensors
    (experts.N.gate_proj / w1, ...) each fill one expert's slice."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 ops: ModuleType):
        super().__init__()
        self.ops = ops
        e, h = cfg.num_experts, cfg.hidden_size
        s, end = split_range(cfg.moe_intermediate_size, ctx.rank, ctx.world_size)
        local = end - s
        self.gate_up_proj = sharded_param((e, 2 * local, h), dtype,
                                          {"gate": (1, s, end, 0), "up": (1, s, end, local)})
        self.down_proj = sharded_param((e, h, local), dtype, {None: (2, s, end, 0)})
        for p in (self.gate_up_proj, self.down_proj):
            p.num_experts = e  # type: ignore[attr-defined]
        self.act = ops.gelu_tanh_mul if cfg.hidden_act == "gelu_tanh" else ops.silu_mul

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s partial output (this rank's share of its intermediate dim) for x."""
        return self.ops.linear(self.act(self.ops.linear(x, self.gate_up_proj[expert])),
                               self.down_proj[expert])


class MoE(DirectModule):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 ops: ModuleType = reference):
        super().__init__()
        self.ctx = ctx
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weights_in_dtype = cfg.family.moe_weights_in_dtype
        self.gate = Router(cfg, dtype, ops)
        self.experts = Experts(cfg, ctx, dtype, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            outputs = self._every_expert(x, chosen)
        else:
            outputs = self._by_expert(x, chosen)
        return self.ctx.all_reduce(self._combine(outputs, weights, x.dtype))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k routing weights and experts ([rows, k] each), highest first."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.weights_in_dtype else weights), chosen

    def _by_expert(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """[rows, k, H]: row t's j-th expert's partial output at [t, j]. The (row, slot) pairs
        are grouped by expert (a stable sort), one call per expert that has rows; the
        per-expert counts come to the host once."""
        rows, k = chosen.shape
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate.weight.shape[0]).tolist()
        out = x.new_empty(rows * k, x.shape[1])
        start = 0
        for expert, n in enumerate(counts):
            if n:
                slots = order[start:start + n]
                out.index_copy_(0, slots, self.experts(expert, x.index_select(0, slots // k)))
                start += n
        return out.view(rows, k, -1)

    def _every_expert(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """_by_expert's result without a host sync or data-dependent shapes (a CUDA graph being
        captured): every expert over every row, each row's picked from them."""
        every = torch.stack([self.experts(e, x) for e in range(self.gate.weight.shape[0])])
        rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
        return every[chosen, rows]

    @staticmethod
    def _combine(outputs: torch.Tensor, weights: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
        """sum_j weights[:, j] * outputs[:, j] in top-k order, accumulated in float32 and
        rounded once (the bits of transformers' .sum(dim=1) of the weighted outputs)."""
        weighted = outputs * weights.unsqueeze(-1)
        acc = weighted[:, 0].float()
        for j in range(1, weighted.shape[1]):
            acc = acc + weighted[:, j]
        return acc.to(dtype)
