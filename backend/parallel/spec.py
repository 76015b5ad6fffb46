"""What a tensor-parallel worker is started with (WorkerSpec) and the constants every side of a
group shares: rank 0 (group.py), its local workers (worker.py) and remote ranks' launchers
(node.py) all import them from here, so none of those modules imports another for them."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

STARTUP_TIMEOUT_S = 600.0
REJOIN = "rejoin"  # close() before a rebuild tells remote ranks to join the next group...
REJOIN_EXIT = 3  # ...and they exit with this code, so that their launcher starts them again
# A worker's first message, before any of its own work: a worker that dies without sending it
# died while its process was bootstrapping (spawn re-imports the parent's __main__ first).
STARTED = "started"


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its rank (picklable)."""
    rank: int
    world: int
    store_path: str  # the FileStore rendezvous file
    shm_name: str
    slot_bytes: int
    model_dir: str
    dtype: str
    num_blocks: int
    block_size: int
    max_model_len: int
    num_threads: int | None
    cpu: int | None  # core to pin to, or None
    # GPU path (comm_select.py): rank r on the r-th GPU from `device`; decode CUDA graphs
    device: str = "cpu"
    cuda_graphs: bool = False
    decode_sizes: tuple[int, ...] = ()
    packed_rows: int = 0  # CPU: linears keep a packed weight copy for batches of this many rows
    greedy_screening: bool = False  # CPU float32: the lm_head slice's bf16 copy (greedy_head.py)
    # multi-host: rank 0's TCP store instead of the file store, gloo for every collective
    master_addr: str = ""
    master_port: int = 0
    gloo_host: str = ""  # the address this rank's gloo sockets bind to ("": torch's default)
    collective_timeout_s: float = 0.0  # > 0: a collective waiting longer fails
    # LoRA adapters (name -> directory, rank 0's order: the adapter ids) each rank shards itself
    lora_modules: dict[str, str] | None = None
    max_lora_rank: int = 16


def python_executable() -> str:
    """The interpreter for workers. Inside Triton's Python-backend stub sys.executable is the stub
    itself, so prefer $TPLLM_PYTHON, then a real python, then the environment's bin/python3."""
    exe = os.environ.get("TPLLM_PYTHON") or sys.executable
    if exe and Path(exe).name.startswith("python") and Path(exe).exists():
        return exe
    fallback = Path(sys.prefix) / "bin" / "python3"
    return str(fallback if fallback.exists() else exe)
