"""Paged KV block bookkeeping: which cache blocks each sequence owns, and (prefix caching) which
full blocks hold which token prefix. No tensors live here.

Prefix caching: a block whose block_size tokens are all computed gets a key chained from its
parent block's key and its own token ids, so a key names the whole prefix up to that block. A new
sequence shares every leading full block whose key is cached (reference counts) and computes only
the rest. A block is shared only once full, and nobody writes into a full block, so a block is
never written while another sequence reads it. Every block 1..num_blocks is in exactly one state:
  empty     ref 0, no key: never used, or freed while partial / uncached (taken first)
  evictable ref 0, keyed: a finished sequence's full block, kept while the pool allows (LRU)
  owned     ref >= 1: in the block table of that many running or preempted-pending sequences

Sliding windows: where every layer of the model is windowed (Mistral), a block whose tokens all
lie behind the window of a sequence's next token is never read by it again; it is released
(release_behind_window: its table entry becomes SCRATCH_BLOCK, which the attention kernels,
starting at the window, never read), so a sequence holds about its window's blocks, not its
whole context's. A released full block stays keyed and hit-able until evicted.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from backend.engine.sequence import Sequence


SCRATCH_BLOCK = 0  # never handed out: padding rows write their K/V here


class NoFreeBlock(Exception):
    """No block is free for an allocation that cannot wait (KVCacheManager.fork)."""


def block_key(parent: bytes, token_ids: list[int]) -> bytes:
    """The key of a full block: a digest of its parent's key and its tokens (sha256: a collision
    would silently serve another prompt's K/V, so no 64-bit hash)."""
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


class KVCacheManager:
    """Hands out blocks 1..num_blocks; the cache tensors hold num_blocks + 1 (block 0 scratch)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 window: int = 0, max_step_tokens: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.window = window  # the narrowest layer's window where every layer has one, else 0
        self.max_step_tokens = max_step_tokens  # the most tokens one step computes for a sequence
        self._ref = [0] * (num_blocks + 1)
        # A stack: recently freed (CPU-cache-warm) blocks are reused first.
        self._empty = list(range(num_blocks, SCRATCH_BLOCK, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._key_of: dict[int, bytes] = {}  # block -> key, for every keyed block
        self._block_of: dict[bytes, int] = {}  # key -> block

    # ---- counts -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: empty ones plus evictable cached ones."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Keyed blocks (owned or evictable): what a new prompt can hit."""
        return len(self._block_of)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def most_blocks_held(self, num_tokens: int) -> int:
        """The most blocks a sequence of num_tokens holds at once: all of them, or with a window
        those from its window's start to the end of its largest step (+ 1: a window straddles
        a block boundary)."""
        if not self.window or not self.max_step_tokens:
            return self.blocks_for(num_tokens)
        return min(self.blocks_for(num_tokens),
                   self.blocks_for(self.window + self.max_step_tokens) + 1)

    # ---- prefix lookup ----------------------------------------------------------------------
    def _keys(self, seq: Sequence, num_full: int) -> list[bytes]:
        """seq's first num_full block keys, extending its memo (its tokens only ever grow)."""
        keys, bs = seq.block_keys, self.block_size
        while len(keys) < num_full:
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else seq.cache_salt,
                                  seq.token_ids[i * bs:(i + 1) * bs]))
        return keys

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding seq's longest cached prefix of full blocks. Read-only. The
        last token is never covered: its logits are needed, so it is always computed (and a
        whole cached prompt recomputes its last block instead of writing into a shared one)."""
        if not self.enable_caching or (seq.embedding is not None and seq.embedding.whole_prompt):
            return []  # (mean / CLS pooling reads every prompt token's hidden state)
        hits = []
        for key in self._keys(seq, (seq.num_tokens - 1) // self.block_size):
            block = self._block_of.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0,
                 prefix: list[int] = ()) -> bool:
        """Grow seq's block table to hold num_tokens, keeping `reserve` blocks free afterwards;
        with `prefix` (match_prefix's blocks, for a sequence holding none yet), those blocks are
        shared first. All or nothing: returns False and changes nothing when blocks are short."""
        assert not prefix or not seq.block_table, "a prefix is shared only by an empty table"
        need = self.blocks_for(num_tokens) - len(seq.block_table) - len(prefix)
        # with a window, the prefix's blocks behind the first uncached token's window are not
        # read again: not shared (release_behind_window's SCRATCH_BLOCK entries)
        behind = self._behind_window(len(prefix) * self.block_size) if prefix else 0
        revived = sum(1 for b in prefix[behind:] if self._ref[b] == 0)  # leave the free pool
        if max(need, 0) + revived + reserve > self.num_free_blocks:
            return False
        seq.block_table.extend([SCRATCH_BLOCK] * behind)
        for b in prefix[behind:]:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
            seq.block_table.append(b)
        for _ in range(need):
            seq.block_table.append(self._take())
        return True

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Give child (holding nothing) parent's K/V of its first num_tokens tokens: the full
        blocks shared, the last partial one copied to a block of its own (both write their next
        tokens there). Returns the (source, copy) pair the caches must copy before the next
        forward, None when there is nothing to copy; raises NoFreeBlock (child unchanged) when
        no block is free for the copy."""
        assert not child.block_table
        full, partial = divmod(num_tokens, self.block_size)
        if partial and not self.num_free_blocks:
            raise NoFreeBlock
        shared = parent.block_table[:full]
        for b in shared:
            if b != SCRATCH_BLOCK:
                self._ref[b] += 1
        child.block_table = list(shared)
        child.block_keys = list(parent.block_keys[:full])
        child.num_keyed_blocks = min(parent.num_keyed_blocks, full)
        if not partial:
            return None
        copy = self._take()
        child.block_table.append(copy)
        return parent.block_table[full], copy

    def _take(self) -> int:
        """An empty block, else the least recently released cached block (its key dropped)."""
        if self._empty:
            b = self._empty.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(b)]
        self._ref[b] = 1
        return b

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key seq's blocks that became full and computed (call after its step ran). A block
        whose prefix another block already holds (computed at the same time) stays unkeyed."""
        if not self.enable_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        keys = self._keys(seq, full)
        for i in range(seq.num_keyed_blocks, full):
            b, key = seq.block_table[i], keys[i]
            if b != SCRATCH_BLOCK and b not in self._key_of and key not in self._block_of:
                self._key_of[b], self._block_of[key] = key, b
        seq.num_keyed_blocks = max(seq.num_keyed_blocks, full)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Tail first, so a prefix's later blocks are evicted before its
        earlier ones (a later block is useless once an earlier one is gone)."""
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table = []
        seq.num_keyed_blocks = 0

    def _release(self, b: int) -> None:
        if b == SCRATCH_BLOCK:  # a block released behind the window already
            return
        self._ref[b] -= 1
        assert self._ref[b] >= 0, f"block {b} freed twice"
        if self._ref[b] == 0:
            if b in self._key_of:
                self._evictable[b] = None
            else:
                self._empty.append(b)

    def _behind_window(self, computed: int) -> int:
        """How many leading blocks lie wholly behind the window of token `computed` (the next
        one a sequence computes): 0 without a window."""
        if not self.window:
            return 0
        return max(0, computed - self.window + 1) // self.block_size

    def computed(self, seq: Sequence) -> None:
        """seq's computed tokens moved on (its step ran, or its drafts were accepted): key its
        blocks that became full, then release those behind its next token's window."""
        self.cache_full_blocks(seq)
        self.release_behind_window(seq)

    def release_behind_window(self, seq: Sequence) -> None:
        """With a window (every layer windowed), release seq's blocks that its next token's
        window starts after."""
        for i in range(min(self._behind_window(seq.num_computed_tokens), len(seq.block_table))):
            if seq.block_table[i] != SCRATCH_BLOCK:
                self._release(seq.block_table[i])
                seq.block_table[i] = SCRATCH_BLOCK

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the cache contents can no longer be trusted, e.g. after
        the TP workers were rebuilt); owned blocks stay owned."""
        self._empty.extend(reversed(self._evictable))
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()

    def check(self, live: list[Sequence]) -> None:
        """Invariants (tests): every block in exactly one state, refs = table occurrences."""
        refs = [0] * (self.num_blocks + 1)
        for s in live:
            for b in s.block_table:
                refs[b] += b != SCRATCH_BLOCK
        assert refs == self._ref, "reference counts differ from the live block tables"
        empty, evict = set(self._empty), set(self._evictable)
        assert len(empty) == len(self._empty) and not empty & evict, "a block freed twice"
        owned = {b for b in range(1, self.num_blocks + 1) if refs[b]}
        assert not owned & (empty | evict), "an owned block is also free"
        assert len(owned | empty | evict) == self.num_blocks, "a block leaked"
        assert all(b in self._key_of for b in evict), "an evictable block without a key"
        assert all(self._key_of[b] == k for k, b in self._block_of.items())
        assert len(self._key_of) == len(self._block_of)
