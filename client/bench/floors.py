"""Hardware floors: what this machine could do at best, measured in-process with the bench's
threads, and the model's FLOP / byte costs that turn them into per-workload lower bounds.

Prefill is compute-bound (GEMM rate), single-sequence decode is bandwidth-bound (every weight is
read once per step, and the sequence's cached K/V once), batched decode is whichever of the two
is slower per step. A batch-1 step's weight bytes are counted as its kernels read them
(step_weight_bytes: SmolLM2's Q4_1 / Q8_0 block copies and int8 head screen, ~112 MB, not its
538 MB of float32); at 1,024 tokens of context its float32 K/V adds 47 MB.
"""
from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from backend.model.config import ModelConfig
from client.bench import benchutil as bu


@dataclass(frozen=True)
class ModelCost:
    layers: int
    heads: int
    head_dim: int
    layer_params: int  # all decoder linears (qkv, o, gate_up, down incl. biases), all layers
    lm_head_params: int
    itemsize: int
    kv_heads: int = 0
    # each layer's sliding window (0: the whole context): a windowed layer's attention reads
    # and computes at most that many keys
    windows: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype: torch.dtype) -> "ModelCost":
        h, hd = cfg.hidden_size, cfg.head_dim
        q, kv, inter = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size
        attention = (h * (q + 2 * kv) + (q + 2 * kv) * cfg.qkv_bias  # qkv_proj
                     + q * h + h * cfg.o_bias)                       # o_proj
        dense = (h * 2 * inter + 2 * inter * cfg.mlp_bias           # gate_up_proj
                 + inter * h + h * cfg.mlp_bias)                     # down_proj
        # a token of a mixture-of-experts layer reads the router and its top-k experts only
        moe = (cfg.num_experts * h + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
               if cfg.moe_layers else 0)
        layer_params = sum(attention + (moe if i in cfg.moe_layers else dense)
                           for i in range(cfg.num_layers))
        return cls(cfg.num_layers, cfg.num_heads, hd, layer_params,
                   cfg.vocab_size * h, torch.empty((), dtype=dtype).element_size(),
                   cfg.num_kv_heads, tuple(cfg.layer_windows))

    def _layer_windows(self) -> tuple[int, ...]:
        return self.windows or (0,) * self.layers

    def forward_flops(self, new_tokens: int, ctx_start: int, logits_rows: int) -> float:
        """FLOPs of one sequence's forward over `new_tokens` tokens after `ctx_start` cached ones:
        linears per token, lm_head only for rows that sample, causal attention (QK^T and PV,
        token at position p attends to p+1 keys, a windowed layer's to at most its window; a
        prefill of L gives ~L^2/2)."""
        seen = torch.arange(ctx_start + 1, ctx_start + new_tokens + 1, dtype=torch.float64)
        keys = sum(float(seen.clamp(max=w).sum() if w else seen.sum())
                   for w in self._layer_windows())
        attn = 2 * 2 * self.heads * self.head_dim * keys
        return 2 * self.layer_params * new_tokens + 2 * self.lm_head_params * logits_rows + attn

    @property
    def weight_bytes(self) -> int:
        """Bytes read per decode step: every linear incl. lm_head (the embedding row is ignored)."""
        return (self.layer_params + self.lm_head_params) * self.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one cached token holds over all layers (the cache has the model's
        dtype); a decode step reads them once per token of its context."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize

    def decode_bytes(self, context: float, sequences: int = 1) -> float:
        """Bytes a decode step of `sequences` rows must read at `context` cached tokens each:
        the weights once, every row's K/V (a windowed layer's within its window)."""
        per_layer = self.kv_bytes_per_token / self.layers
        kv = sum(per_layer * (min(context, w) if w else context) for w in self._layer_windows())
        return self.weight_bytes + sequences * kv

    def mean_decode_bytes(self, input_len: int, output_len: int) -> float:
        """A batch-1 decode step's bytes at the mean context of an input_len / output_len
        request: the floor's bytes per output token."""
        return self.decode_bytes(input_len + output_len / 2)


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


_PROJECTIONS = (("qkv", "self_attn", "qkv_proj"), ("o", "self_attn", "o_proj"),
                ("gate_up", "mlp", "gate_up_proj"), ("down", "mlp", "down_proj"))


def decode_linears(model) -> list:
    """Every decoder linear of `model` (a LlamaForCausalLM) in the order a decode step runs
    them: each layer's qkv, o, gate_up, down."""
    return [getattr(getattr(layer, block), name) for layer in model.layers
            for _, block, name in _PROJECTIONS if hasattr(getattr(layer, block), name)]


def _weight_read_bytes(weight) -> int:
    """A weight's bytes as a batch-1 step reads them: its exact block copy where it has one
    (tpllm_kernels/cpu_blocks.py: codes and scales), else itself."""
    copy = getattr(weight, "block_copy", None)
    return _nbytes(*copy[1:]) if copy is not None else _nbytes(weight)


def _read_bytes(lin) -> int:
    return _weight_read_bytes(lin.weight) + _nbytes(getattr(lin, "bias", None))


def layer_linear_bytes(model) -> dict[str, int]:
    """_read_bytes of each projection kind (qkv, o, gate_up, down), summed over the layers; a
    mixture-of-experts layer's gate_up / down: its top-k experts' (what a token reads), its
    router counted with gate_up."""
    out = dict.fromkeys((kind for kind, _, _ in _PROJECTIONS), 0)
    for layer in model.layers:
        for kind, block, name in _PROJECTIONS:
            part = getattr(layer, block)
            if hasattr(part, name):
                out[kind] += _read_bytes(getattr(part, name))
            elif hasattr(part, "experts"):  # backend/model/moe.py
                w = getattr(part.experts, name)
                out[kind] += part.top_k * w[0].numel() * w.element_size()
                out[kind] += _nbytes(part.gate.weight) if kind == "gate_up" else 0
    return out


def step_weight_bytes(model) -> dict[str, int]:
    """The weight bytes a greedy batch-1 decode step of `model` (a loaded LlamaForCausalLM, one
    rank) reads, as its kernels read them: every decoder linear's _read_bytes; the lm_head's
    greedy screen (its int8 copy, scales and bound factors: backend/model/greedy_head.py) where
    there is one, else the head as its linear reads it. Norms and the rows the screen
    recomputes are left out (under 1% for SmolLM2). {"layers", "lm_head", "total"}."""
    layers = sum(layer_linear_bytes(model).values())
    head = model.lm_head
    screen = getattr(head, "screen", None)
    head_bytes = (_nbytes(*screen.copies) if screen is not None
                  else _weight_read_bytes(head.weight))
    return {"layers": layers, "lm_head": head_bytes, "total": layers + head_bytes}


def read_decode_bytes(weight_bytes: int, cost: ModelCost, context: float) -> float:
    """A batch-1 decode step's bytes as read: `weight_bytes` (step_weight_bytes) plus the
    context's K/V in the cache's dtype."""
    return weight_bytes + cost.kv_bytes_per_token * context


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, runs: int = 5) -> float:
    """Best-of-`runs` GFLOP/s of x[m,k] @ w[n,k]^T by the faster of the GEMMs the engine's
    linears may run on (torch's F.linear: MKL; oneDNN's linear), whichever the engine picked:
    a floor is the best this machine does, not the best our choice does."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    from tpllm_kernels import cpu_ops
    gemms = [lambda: F.linear(x, w)]
    if cpu_ops._onednn_available():
        gemms.append(lambda: cpu_ops._onednn_linear(x, w, None))
    best = float("inf")
    for gemm in gemms:
        gemm()  # warm-up: thread pool start, kernel selection
        for _ in range(runs):
            t0 = time.perf_counter()
            gemm()
            best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


def read_bandwidth_gbs(gib: float = 1.0, runs: int = 5) -> float:
    """Best-of-`runs` GB/s of reading a buffer far larger than the caches, the faster of two
    readers: torch's float sum, and (when the kernels load) their own probe, which reads one
    contiguous slice per thread as a decode GEMV does (csrc/thread_team_bindings.cpp). Neither is
    always the faster on this VM. The buffer is filled with ones (not torch.empty) so its
    pages are really mapped and the reads reach DRAM, not the zero page."""
    buf = torch.ones(int(gib * 2**30) // 64 * 16, dtype=torch.float32)
    from tpllm_kernels import cpu_ext
    ext = cpu_ext.load()  # None without a compiler: torch's reader alone
    readers = [buf.sum] + ([lambda: ext.read_probe(buf)] if ext is not None else [])
    best = float("inf")
    for read in readers:
        read()
        for _ in range(runs):
            t0 = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - t0)
    nbytes = buf.numel() * buf.element_size()
    del buf
    gc.collect()
    return nbytes / best / 1e9


def measure(cfg: ModelConfig, dtype: torch.dtype, prefill_len: int) -> dict:
    """Machine rates for this model: GEMM shaped like its biggest prefill GEMM (gate_up), and
    memory read bandwidth."""
    m, k, n = prefill_len, cfg.hidden_size, 2 * cfg.intermediate_size
    return {"matmul_shape": [m, k, n], "matmul_gflops": matmul_gflops(m, k, n, dtype),
            "read_bandwidth_gbs": read_bandwidth_gbs()}


def single_floor(cost: ModelCost, rates: dict, input_len: int, output_len: int,
                 weight_bytes: int | None = None) -> dict:
    """Concurrency-1 floors: TTFT = prefill FLOPs / GEMM rate; TPOT = the bytes of a decode step
    at the mean context / bandwidth: the weights as the step reads them (`weight_bytes`, from
    step_weight_bytes) where given, else in the model's dtype, plus the K/V."""
    prefill_flops = cost.forward_flops(input_len, 0, 1)
    ttft = prefill_flops / (rates["matmul_gflops"] * 1e9)
    context = input_len + output_len / 2
    step_bytes = (read_decode_bytes(weight_bytes, cost, context) if weight_bytes is not None
                  else cost.decode_bytes(context))
    tpot = step_bytes / (rates["read_bandwidth_gbs"] * 1e9)
    return {"prefill_flops": prefill_flops, "decode_bytes_per_token": step_bytes,
            "weights_as_read": weight_bytes is not None,
            "ttft_s": ttft, "tpot_s": tpot, "e2e_s": ttft + (output_len - 1) * tpot}


def batch_floor(cost: ModelCost, rates: dict, n: int, input_len: int, output_len: int) -> dict:
    """Floor of `n` requests at once: all prefills at the GEMM rate, then each decode step costs
    the slower of its compute (n rows) and one read of the weights and of the n contexts' K/V."""
    rate, bw = rates["matmul_gflops"] * 1e9, rates["read_bandwidth_gbs"] * 1e9
    prefill = n * cost.forward_flops(input_len, 0, 1) / rate
    decode = sum(max(n * cost.forward_flops(1, input_len + j, 1) / rate,
                     cost.decode_bytes(input_len + j, n) / bw)
                 for j in range(output_len - 1))
    wall = prefill + decode
    return {"wall_s": wall, "prefill_s": prefill, "decode_s": decode,
            "output_tok_s": n * output_len / wall,
            "total_tok_s": n * (input_len + output_len) / wall}


def cost_dict(cost: ModelCost) -> dict:
    return asdict(cost) | {"weight_bytes": cost.weight_bytes,
                           "kv_bytes_per_token": cost.kv_bytes_per_token}


def paired_steps(llm, prompt: list[int], tokens: int, step_bytes: float) -> dict | None:
    """Each decode step of one request (`tokens` out of `prompt`, greedy) right after a read of
    as many bytes as the step reads (the kernels' read probe, the same threads): the step's time
    over the time that read took; None without the C++ kernels.
    This VM's read bandwidth swings from ~18 to ~43 GB/s between consecutive 1 GiB reads, so a
    best-of-5 floor is the top of that spread while a step sees whatever it gets; a read right
    next to each step sees what the step sees."""
    from backend import SamplingParams
    from tpllm_kernels import cpu_ext
    ext = cpu_ext.load()
    if ext is None:  # no kernels, no probe
        return None
    engine = llm.engine
    buf = torch.ones(int(step_bytes) // 64 * 16, dtype=torch.float32)  # pages mapped, not zero
    ext.read_probe(buf)
    nbytes = buf.numel() * buf.element_size()
    engine.add_request("paired", prompt, SamplingParams(temperature=0, max_tokens=tokens,
                                                        ignore_eos=True))
    ratios, steps, reads = [], [], []
    produced = 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        ext.read_probe(buf)
        t1 = time.perf_counter()
        outs = engine.step()
        t2 = time.perf_counter()
        was_decode = produced > 0  # the prompt's steps (the last one samples token 1) are not
        produced += sum(len(o.token_ids) for o in outs)
        if not was_decode:
            continue
        ratios.append((t2 - t1) / (t1 - t0))
        steps.append(t2 - t1)
        reads.append(nbytes / (t1 - t0) / 1e9)
    del buf
    gc.collect()
    return {"ratio": bu.summarize(ratios), "step_s": bu.summarize(steps),
            "read_gbs": bu.summarize(reads), "probe_bytes": nbytes}
