"""Engine settings: what to load and where, how big the KV pool and the batches are, threads."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from backend.engine.lora import validate_lora_settings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MASTER_PORT = 29500  # torch.distributed's customary port
# A step's fixed cost, in tokens of compute: a small step still reads all the weights, so it
# costs far more per token than a large one. 16 on CPU comes from step timings at 8-64 tokens
# and `python -m client bench prefix` (docs/decisions.md, "Requests waiting together are
# admitted in groups"); no GPU measurement yet, so no default there
CPU_STEP_OVERHEAD_TOKENS = 16


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory; None = the embedded SmolLM2-135M-Instruct
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    num_threads: int | None = None  # torch intra-op threads per rank; None = cores / TP degree
    pin_cpus: bool = False  # pin rank r to core r (TP comparisons on a quiet machine)
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size; else sized by kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # what a step costs beyond its tokens, in tokens of compute: requests waiting together are
    # admitted in groups sized by it (scheduler.py), and a prompt's last chunk is padded up to
    # its bucket rather than split when the padding is at most this; None = 16 on CPU, 0 (no
    # grouping; pad only when it computes fewer tokens than it would cut) on CUDA
    step_overhead_tokens: int | None = None
    max_model_len: int | None = None  # None = the model's context (max_position_embeddings)
    # CPU float32: a second, packed copy of every linear weight (in the GEMM library's format:
    # tpllm_kernels.cpu_ops.GEMM_LIBRARY) for the full decode batch (max_num_seqs rows) when it is
    # above tpllm_kernels.cpu_ops.SMALL_M (48 with oneDNN, 64 with MKL; up to that the C++
    # linears are faster): decode batches above it and prefill chunks run their GEMMs from it,
    # faster than packing each weight per call (`python -m client bench offline`;
    # docs/decisions.md, "Packed weight copies"); costs the weights' memory again
    cpu_packed_gemm: bool = True
    # reuse the KV blocks of a prompt prefix computed before (kv_manager); off only for A/B
    enable_prefix_caching: bool = True
    # speculative decoding by prompt lookup (speculation.py): draft tokens per step at most
    # (0 = off), and the n-gram matched against the sequence's own context (when it never
    # occurred before: the copy the last draft came from, then shorter n-grams); 4 drafted the
    # fewest rows for the most accepted tokens of 2-6 (`python -m client bench speculation`'s
    # prompts; docs/decisions.md, "Speculation stays off by default")
    speculative_ngram: int = 0
    speculative_ngram_match: int = 4
    # CPU float32 and bf16: steps whose rows are all plain greedy read an int8 (or bf16) copy
    # of the lm_head (each TP rank its slice) and only the few rows that can win (exact tokens;
    # the copy costs 0.28x (0.5x) a float32 head's memory again, 0.56x a bf16 one's:
    # backend/model/greedy_head.py); off only for A/B
    greedy_screening: bool = True
    warmup: bool = True  # run every bucket before ready (off only to measure what it buys)
    seed: int | None = None  # seeds the generator of requests without a seed; None = random
    # embeddings: "last", "mean" or "cls" overrides the checkpoint's pooling (its
    # sentence-transformers modules.json; without one: last token); None: the checkpoint's
    pooling: str | None = None
    device: str = "auto"  # cpu | cuda | cuda:N (TP rank r on cuda:N+r) | auto (cuda if visible)
    cuda_graphs: bool = True  # on CUDA, decode steps replay one captured graph per batch bucket
    # Multi-host TP (docs/parallelism.md, "Beyond one machine"): ranks tp_local_ranks..N-1 run on
    # other hosts, started there by `python -m backend.parallel.node`.
    tp_local_ranks: int | None = None  # ranks on this host, rank 0 included; None = all of them
    tp_master_addr: str | None = None  # this host's address the others reach; else $MASTER_ADDR
    tp_master_port: int | None = None  # rank 0's store port (+1: step channels); else $MASTER_PORT
    tp_collective_timeout_s: float = 60.0  # multi-host: a collective stuck this long fails
    # LoRA adapters (backend/engine/lora.py): served with the base model, requested by
    # SamplingParams.lora_name; max_loras distinct adapters per step, ranks up to max_lora_rank,
    # lora_modules (name -> PEFT adapter directory) all loaded at start, at most max_cpu_loras
    # of them (None: no cap)
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: dict[str, str] | None = None

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.pooling is not None and self.pooling not in ("last", "mean", "cls"):
            raise ValueError(f"pooling: must be last, mean or cls, got {self.pooling!r}")
        for name in ("tensor_parallel_size", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        for name, low in (("speculative_ngram", 0), ("speculative_ngram_match", 1),
                          ("step_overhead_tokens", 0)):
            v = getattr(self, name)
            if v is None and name == "step_overhead_tokens":  # None: the device's default
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name}: must be an integer >= {low}, got {v!r}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads: must be an integer >= 1, got {self.num_threads!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {self.num_kv_blocks!r}")
        if self.num_kv_blocks is None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb: must be > 0, got {self.kv_cache_memory_gb!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len!r}")
        validate_lora_settings(self.enable_lora, self.max_loras, self.max_lora_rank,
                               self.max_cpu_loras, self.lora_modules)
        device = self.resolved_device()
        self._validate_multi_host(device)

    def _validate_multi_host(self, device: torch.device) -> None:
        tp, local = self.tensor_parallel_size, self.tp_local_ranks
        if local is not None and (not isinstance(local, int) or not 1 <= local <= tp):
            raise ValueError(f"tp_local_ranks: must be an integer in 1..tensor_parallel_size "
                             f"({tp}), got {local!r}")
        if not self.tp_remote_ranks:
            if self.tp_master_addr is not None:  # the env vars alone never matter here
                raise ValueError("tp_master_addr: only used when tp_local_ranks < "
                                 "tensor_parallel_size (some ranks on other hosts)")
            return
        if device.type != "cpu":
            raise ValueError(f"tp_local_ranks: ranks on other hosts need device 'cpu' (the GPU "
                             f"communicator is one-host), got device {self.device!r}")
        if not self.tp_collective_timeout_s > 0:
            raise ValueError("tp_collective_timeout_s: must be > 0, got "
                             f"{self.tp_collective_timeout_s!r}")
        self.resolved_master()

    @property
    def tp_remote_ranks(self) -> int:
        """How many ranks run on other hosts (0: the whole group is on this one)."""
        return self.tensor_parallel_size - (self.tp_local_ranks or self.tensor_parallel_size)

    def resolved_master(self) -> tuple[str, int]:
        """Rank 0's (address, store port) for a multi-host group: the fields, else $MASTER_ADDR /
        $MASTER_PORT, else port 29500. Raises ValueError naming the field."""
        addr = self.tp_master_addr if self.tp_master_addr is not None else os.environ.get(
            "MASTER_ADDR", "")
        if not isinstance(addr, str) or not addr.strip():
            raise ValueError("tp_master_addr: required when some ranks run on other hosts (an "
                             "address of this host they can reach; or set MASTER_ADDR), got "
                             f"{self.tp_master_addr!r}")
        port = self.tp_master_port
        if port is None:
            env = os.environ.get("MASTER_PORT", "")
            try:
                port = int(env) if env.strip() else DEFAULT_MASTER_PORT
            except ValueError:
                raise ValueError(f"tp_master_port: MASTER_PORT={env!r} is not a port") from None
        if not isinstance(port, int) or not 1 <= port <= 65534:  # port + 1 is used too
            raise ValueError(f"tp_master_port: must be an integer in 1..65534, got {port!r}")
        return addr.strip(), port

    def resolved_device(self) -> torch.device:
        """Rank 0's device ("auto" resolved); raises ValueError naming the field."""
        d = str(self.device).strip().lower()
        if d == "auto":
            d = "cuda" if torch.cuda.is_available() else "cpu"
        if d == "cpu":
            return torch.device("cpu")
        m = re.fullmatch(r"cuda(?::(\d+))?", d)
        if not m:
            raise ValueError("device: must be 'auto', 'cpu', 'cuda' or 'cuda:N', "
                             f"got {self.device!r}")
        if not torch.cuda.is_available():
            raise ValueError(f"device: {d} requested but torch sees no CUDA device "
                             f"(torch {torch.__version__}); use device 'cpu' or 'auto'")
        first, n = int(m.group(1) or 0), torch.cuda.device_count()
        last = first + self.tensor_parallel_size - 1  # rank r runs on cuda:first+r
        if last >= n:
            raise ValueError(f"device: {d} with tensor_parallel_size {self.tensor_parallel_size} "
                             f"needs CUDA devices {first}..{last} but torch sees {n}")
        return torch.device("cuda", first)

    def resolved_step_overhead_tokens(self, device: torch.device) -> int:
        if self.step_overhead_tokens is not None:
            return self.step_overhead_tokens
        return CPU_STEP_OVERHEAD_TOKENS if device.type == "cpu" else 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
