"""The finite set of step shapes the engine runs, known at load.

Decode-only steps are padded to a batch bucket (1-8, then multiples of 8). Steps that carry a
prompt chunk have their total token count fitted to a token bucket (steps of ~1.5x): first by
trimming the last prompt chunk down to a bucket (free: the rest runs next step), else by padding.
Warmup runs every bucket before READY; afterwards nothing new should ever appear.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


def _token_sizes(limit: int) -> list[int]:
    sizes, p = [8], 16
    while p < limit:
        sizes += [p, p + p // 2]
        p *= 2
    return sorted({s for s in sizes if s < limit} | {limit})


@dataclass(frozen=True)
class BucketPlan:
    decode_sizes: tuple[int, ...]
    token_sizes: tuple[int, ...]

    @classmethod
    def build(cls, max_num_seqs: int, max_num_batched_tokens: int) -> "BucketPlan":
        rows = min(max_num_seqs, max_num_batched_tokens)
        decode = sorted({*range(1, min(rows, 8) + 1), *range(8, rows + 1, 8), rows})
        return cls(tuple(decode), tuple(_token_sizes(max_num_batched_tokens)))

    def decode_bucket(self, rows: int) -> int:
        return self.decode_sizes[bisect.bisect_left(self.decode_sizes, rows)]

    def token_bucket(self, tokens: int) -> int:
        return self.token_sizes[bisect.bisect_left(self.token_sizes, tokens)]

    def bucket_at_most(self, tokens: int) -> int | None:
        """The largest token bucket <= tokens (a step can be trimmed down to it), if any."""
        i = bisect.bisect_right(self.token_sizes, tokens)
        return self.token_sizes[i - 1] if i else None

    @property
    def num_buckets(self) -> int:
        return len(self.decode_sizes) + len(self.token_sizes)
