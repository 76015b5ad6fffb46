"""Per-step attention inputs, shared by every layer of one forward pass.

The engine fills the primary fields (block tables, lengths); derived tensors that a given
kernel path needs (gather indices, masks) are built lazily once per step, not once per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import torch


@lru_cache(maxsize=64)
def uniform_kv_index(num_q: int, num_kv: int) -> torch.Tensor:
    """The KV head each of num_q query heads reads when they share num_kv heads evenly (GQA):
    the kernels' kv_index where the model passes none."""
    return torch.arange(num_q) // (num_q // num_kv)


@dataclass
class DecodeBatch:
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [B], including the token being decoded
    max_context: int
    block_size: int
    # max_context is an upper bound (a CUDA graph's fixed shape), not this batch's longest
    # context: the torch path must then mask every row, a single one too
    bounded: bool = False

    @property
    def size(self) -> int:
        return self.block_tables.shape[0]

    @cached_property
    def num_blocks(self) -> int:
        return -(-self.max_context // self.block_size)

    @cached_property
    def gather_index(self) -> torch.Tensor:
        """Flat block ids covering max_context for every sequence: [B * num_blocks]."""
        return self.block_tables[:, :self.num_blocks].reshape(-1)

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """[B, 1, 1, L] key validity; None when one sequence is sliced to its exact length."""
        if self.size == 1 and not self.bounded:
            return None
        pos = torch.arange(self.num_blocks * self.block_size, device=self.context_lens.device)
        return (pos[None, :] < self.context_lens[:, None]).view(self.size, 1, 1, -1)


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flat batch
    length: int  # tokens in the chunk
    context_len: int  # tokens of the sequence in cache once this chunk is written
    block_table: torch.Tensor  # [num_blocks] int64

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """Causal mask over the cached prefix + chunk; None when there is no prefix."""
        if self.context_len == self.length:
            return None
        dev = self.block_table.device
        qpos = torch.arange(self.context_len - self.length, self.context_len, device=dev)
        return torch.arange(self.context_len, device=dev)[None, :] <= qpos[:, None]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    cos: torch.Tensor  # [T, head_dim]
    sin: torch.Tensor
    decode: DecodeBatch | None = None  # the first decode.size rows of the batch
    prefills: list[PrefillChunk] = field(default_factory=list)
    num_padding: int = 0  # trailing rows after the prefill chunks that attend to nothing
    # windowed layers' own rotary tables where they have their own rope (Gemma 3), else None
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None

    def rope(self, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) a layer rotates with: the local pair for a layer that has one."""
        if local and self.local_cos is not None:
            return self.local_cos, self.local_sin
        return self.cos, self.sin

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode is None else self.decode.size
