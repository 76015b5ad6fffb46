"""Streaming detokenizer for one request: token ids in, UTF-8-safe text deltas out, stop strings.

Decoding uses the prefix_offset/read_offset scheme (as in vLLM): each step decodes only a short
window of recent tokens and emits the part after what was already read, so the cost per token does
not grow with the output length. Only the window's token ids are kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

# Prompt tokens that seed the decode window, so the first output token decodes as it would
# mid-text (SentencePiece drops the leading space of the first token of a decode call).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizerUpdate:
    delta: str  # new text to send to the client now (may be "")
    stopped: bool = False  # a stop string matched
    stop_reason: str | None = None  # the stop string that matched


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = [s for s in dict.fromkeys(stop) if s]  # "" would match everywhere: ignore it
        self._include_stop = include_stop_str_in_output
        # Window, starting at the prefix offset (older ids are dropped): _ids[:_read_offset] was
        # already emitted and is decoder context only; _ids[_read_offset:] is not emitted yet
        # (e.g. the first bytes of a multi-byte character).
        self._ids: list[int] = list(prompt_token_ids)[max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS):]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._pending = ""  # decoded text held back because it may be the start of a stop string
        self._chunks: list[str] = []  # everything emitted so far
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        if len(self._chunks) > 1:  # join lazily, keep one chunk so repeated reads stay cheap
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        if self.stopped:  # the request is over; late tokens produce nothing
            return DetokenizerUpdate("", True, self.stop_reason)
        # One token at a time so a trailing partial character only delays its own bytes.
        new_text = "".join(self._decode_next(t) for t in token_ids)
        delta = self._emit(new_text, final=False)
        return DetokenizerUpdate(delta, self.stopped, self.stop_reason)

    def flush(self) -> str:
        """Release held-back text when the request ends for a reason other than a stop string."""
        if self.stopped:
            return ""
        # Undecodable trailing bytes are released as U+FFFD, exactly as a full decode shows them.
        full = self._decode(self._ids)
        rest = full[len(self._prefix_text):] if len(full) > len(self._prefix_text) else ""
        self._advance()
        return self._emit(rest, final=True)

    # -- internals ---------------------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        # No clean-up of tokenization spaces: it is not incremental (it looks across the window
        # boundary), so it would make the stream differ from a full decode.
        return self._tokenizer.decode(
            list(ids), skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        full = self._decode(self._ids)
        # No growth: a skipped special token. Trailing U+FFFD: a multi-byte character split across
        # tokens; its remaining bytes are still to come, so emit nothing and keep the offsets.
        if len(full) <= len(self._prefix_text) or full.endswith(REPLACEMENT_CHAR):
            return ""
        new_text = full[len(self._prefix_text):]
        self._advance()
        return new_text

    def _advance(self) -> None:
        """The whole window is now read; its unread part becomes the next decode context."""
        del self._ids[: self._read_offset]  # tokens before it can no longer affect decoding
        self._read_offset = len(self._ids)
        # Decoded alone, not sliced from the old window: SentencePiece strips the leading space of
        # a decode call's first token, and the next window starts with these same tokens.
        self._prefix_text = self._decode(self._ids)

    def _emit(self, new_text: str, final: bool) -> str:
        text = self._pending + new_text
        hit = self._find_stop(text)
        if hit is not None:
            start, stop = hit
            delta = text[: start + len(stop)] if self._include_stop else text[:start]
            self.stopped, self.stop_reason, self._pending = True, stop, ""
        else:
            hold = 0 if final else self._stop_prefix_len(text)
            delta, self._pending = text[: len(text) - hold], text[len(text) - hold:]
        if delta:
            self._chunks.append(delta)
        return delta

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that completes first in `text` (ties: the one starting first).

        Ordering by end position makes the result independent of how tokens are batched: it is
        what a character-by-character stream would have hit first. A match can only start inside
        `text` (never in emitted text) because any possible stop prefix is held back.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            i = text.find(stop)
            if i >= 0 and (best is None or (i + len(stop), i) < best[:2]):
                best = (i + len(stop), i, stop)
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        hold = 0
        for stop in self._stop:
            i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
            while i != -1 and len(text) - i > hold:
                if stop.startswith(text[i:]):
                    hold = len(text) - i
                    break
                i = text.find(stop[0], i + 1)
        return hold
