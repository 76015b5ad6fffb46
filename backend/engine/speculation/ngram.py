"""Prompt-lookup drafting: guess a sequence's next tokens by finding its last n tokens earlier in
its own prompt + output and copying what followed them there. No draft model; it pays off where
the output repeats the input (edits of code, copied lists, extraction, quoting).

The index is built once per sequence (O(prompt)) and then extended by one n-gram per new
token, so a proposal costs a dict lookup whatever the context length.
"""
from __future__ import annotations


def copy_from(token_ids: list[int], start: int, k: int) -> list[int]:
    """k tokens copied from token_ids[start:], the copy continuing into itself past the end:
    a match a period p back (a repeated line, a loop) drafts the whole period and more, not
    only the p tokens that happen to follow it so far. start < len(token_ids)."""
    length = len(token_ids)
    out = token_ids[start:start + k]
    while len(out) < k:
        out.append(out[start + len(out) - length])
    return out


def agreeing(draft: list[int], tokens: list[int]) -> int:
    """How many of draft's first tokens equal `tokens` (the model's, in order): the drafts a
    verification accepts."""
    a = 0
    while a < len(draft) and a < len(tokens) and draft[a] == tokens[a]:
        a += 1
    return a


class NgramIndex:
    """Where each n-gram of a token list last ended (the index of the token that followed it)."""

    def __init__(self, n: int):
        self.n = n
        self._next_of: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before token_ids[_indexed] are in the table
        self.last_start: int | None = None  # where the last proposal was copied from

    def _extend(self, token_ids: list[int], upto: int) -> None:
        """Index the n-grams followed by a token in token_ids[:upto] (most recent wins)."""
        n, table = self.n, self._next_of
        for end in range(max(self._indexed, n), upto):
            table[tuple(token_ids[end - n:end])] = end
        self._indexed = max(self._indexed, upto)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the last n tokens
        (copy_from: continued past the end); [] when they never occurred before (or the context
        is shorter than n + 1)."""
        self.last_start = None
        length = len(token_ids)
        if k <= 0 or length <= self.n:
            return []
        # every n-gram that has a known successor, i.e. ends before the current last token
        self._extend(token_ids, length)
        start = self._next_of.get(tuple(token_ids[length - self.n:]))
        if start is None or start >= length:
            return []
        self.last_start = start
        return copy_from(token_ids, start, k)
