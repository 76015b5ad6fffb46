"""How a layer's output features, heads and vocabulary split across tensor-parallel ranks.

Splits are contiguous and may be uneven (SmolLM2 has 9 query heads, TP 2 gives 4 + 5). With GQA
each rank keeps exactly the KV heads its query heads read, so a KV head may live on two ranks.
"""
from __future__ import annotations

from dataclasses import dataclass


def split_range(total: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous share of `total` items. The last ranks get the extra:
    rank 0 also schedules and samples between steps, so it gets the lighter share."""
    base, extra = divmod(total, world)
    first_big = world - extra
    start = rank * base + max(0, rank - first_big)
    return start, start + base + (1 if rank >= first_big else 0)


@dataclass(frozen=True)
class HeadPartition:
    q_start: int
    q_end: int
    kv_start: int
    kv_end: int
    group: int  # query heads per KV head in the full model

    @classmethod
    def build(cls, num_heads: int, num_kv_heads: int, rank: int, world: int) -> "HeadPartition":
        if world > num_heads:
            raise ValueError(f"tensor_parallel_size {world} exceeds the model's {num_heads} attention heads")
        group = num_heads // num_kv_heads
        q0, q1 = split_range(num_heads, rank, world)
        return cls(q0, q1, q0 // group, (q1 - 1) // group + 1, group)

    @property
    def num_q(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv(self) -> int:
        return self.kv_end - self.kv_start

    def kv_index_for_q(self) -> list[int]:
        """Local KV head read by each local query head."""
        return [h // self.group - self.kv_start for h in range(self.q_start, self.q_end)]

    @property
    def owned_kv(self) -> tuple[int, int]:
        """The local KV heads' [start, end) (local indices) that no lower rank also holds: with
        GQA a KV head may live on two ranks, and a sum over all KV heads must count it once.
        The lower ranks' query heads end at q_start, so their KV heads end at that head's."""
        below_end = (self.q_start - 1) // self.group + 1 if self.q_start else 0
        return max(below_end - self.kv_start, 0), self.num_kv

    @property
    def uniform_groups(self) -> bool:
        """True when local query heads map to local KV heads in equal consecutive groups."""
        idx = self.kv_index_for_q()
        g = self.num_q // self.num_kv
        return g * self.num_kv == self.num_q and idx == [i // g for i in range(self.num_q)]
