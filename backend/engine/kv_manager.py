"""Paged KV block bookkeeping: which cache blocks each sequence owns. No tensors live here."""
from __future__ import annotations

from backend.engine.sequence import Sequence


SCRATCH_BLOCK = 0  # never handed out: padding rows write their K/V here


class KVCacheManager:
    """Hands out blocks 1..num_blocks; the cache tensors hold num_blocks + 1 (block 0 scratch)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: recently freed (cache-warm) blocks are reused first.
        self._free = list(range(num_blocks, SCRATCH_BLOCK, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        """Grow seq's block table to hold num_tokens, keeping `reserve` blocks free afterwards.
        All or nothing: returns False and changes nothing when blocks are short."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need + reserve > len(self._free):
            return False
        for _ in range(need):
            seq.block_table.append(self._free.pop())
        return True

    def free(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.block_table))
        seq.block_table = []
