"""Starting the tensor-parallel worker processes of an engine: what each rank needs to know (the
worker spec) and how big the shared-memory slots of the collectives must be."""
from __future__ import annotations

from pathlib import Path

import torch

from backend.engine.config import EngineConfig
from backend.model.config import ModelConfig
from backend.parallel.partition import split_range


def launch_group(c: EngineConfig, cfg: ModelConfig, model_dir: Path, num_blocks: int,
                 threads: int | None, max_model_len: int, decode_sizes: tuple[int, ...],
                 packed_rows: int, cuda_graphs: bool, device: torch.device):
    """The started TPGroup (rank 0 is the caller; ranks 1.. are launched, here or on the
    hosts that run `python -m backend.parallel.node`)."""
    from backend.engine.tp.group import TPGroup
    from backend.parallel.spec import WorkerSpec
    tp = c.tensor_parallel_size
    vocab_shard = max(e - s for s, e in (split_range(cfg.vocab_size, r, tp) for r in range(tp)))
    # a slot holds a step's hidden states (all-reduce) or its logits shards (gather): at most
    # max_num_seqs sampled rows, verify rows of speculative decoding included (speculation.py)
    slot_bytes = c.torch_dtype.itemsize * max(c.max_num_batched_tokens * cfg.hidden_size,
                                              c.max_num_seqs * vocab_shard)
    # multi-host: rank 0 hosts the store; its own and its local workers' gloo sockets bind
    # to the master address, which the other hosts reach
    addr, port = c.resolved_master() if c.tp_remote_ranks else ("", 0)
    return TPGroup(WorkerSpec(
        rank=0, world=tp, store_path="", shm_name="", slot_bytes=slot_bytes,
        model_dir=str(model_dir), dtype=c.dtype, num_blocks=num_blocks,
        block_size=c.block_size, max_model_len=max_model_len, num_threads=threads,
        cpu=0 if c.pin_cpus else None, device=str(device),
        cuda_graphs=cuda_graphs, decode_sizes=decode_sizes, packed_rows=packed_rows,
        greedy_screening=c.greedy_screening,
        master_addr=addr, master_port=port, gloo_host=addr,
        collective_timeout_s=c.tp_collective_timeout_s if addr else 0.0,
        lora_modules=c.lora_modules, max_lora_rank=c.max_lora_rank),
        c.torch_dtype, local_ranks=c.tp_local_ranks)
