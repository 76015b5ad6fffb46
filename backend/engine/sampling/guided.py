"""Structured output on xgrammar: compile each constraint once, mask each constrained row's logits.

- GrammarCache compiles on its own thread (never the engine thread), one compile per distinct
  canonical constraint, kept in a bounded LRU; requests with the same schema share one Future.
- GuidedState is one request's matcher plus the bitmask of the tokens it may take next. The
  engine starts it once the Future is done; until then the scheduler holds back the request's
  last prompt token (the one whose logits are sampled), so its prefill overlaps the compile.
- GuidedMasker is the sampler's hook: it masks the constrained rows in place on the logits the
  sampler already has (same tensor: nothing new for the cold-path counter), before penalties,
  temperature and the top-k/top-p/min-p filters. Unconstrained rows are not touched.

Masking on CPU uses numpy, which never opens a parallel region. torch ops (a [n, words, 32]
shift-and-compare, then masked_fill_) open an OpenMP region for each vocabulary-sized op, after
which libgomp's worker (wait policy unset, the benchmarks' default) spins into the next forward
pass, on the core the kernels' worker team needs; xgrammar's CPU kernel spins threads of its
own. With numpy, constrained steps were within noise of unconstrained ones (`python -m client
bench structured`; docs/decisions.md, "Structured output masks logits in numpy"). Other
devices keep the torch ops (no OpenMP there, and no kernel to compile).

The next bitmask is filled inline, right after the token is accepted: handing the fill to a
worker thread to overlap the next forward pass cost the engine thread as much as the fill
itself, and would put a third thread on the 2 cores the forward needs (docs/decisions.md).

EOS (the engine's stop ids) is allowed exactly where the grammar may end. A matcher that can
take nothing but EOS is complete: the engine finishes the request ("stop") without sampling it.
"""
from __future__ import annotations

import re
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Sequence

import numpy as np
import torch

from backend.engine.sampling.guided_spec import GuidedSpec

DEFAULT_CACHE_ENTRIES = 256
# logits dtypes masked through a numpy view (numpy has no bfloat16); the byte view needs the
# bitmask's int32 words little-endian
_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)
_LITTLE_ENDIAN = sys.byteorder == "little"


def _load_xgrammar():
    try:
        import xgrammar
    except ImportError:  # a dependency in pyproject.toml; say what is missing, per request
        raise ValueError("structured output needs the xgrammar package (pip install xgrammar)") \
            from None
    return xgrammar


def _compile_error(spec: GuidedSpec, e: BaseException) -> ValueError:
    """xgrammar's message without its '[time] /path/file.cc:line: ' prefix, naming the field."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    msg = re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", msg)
    return ValueError(f"{spec.field}: cannot be compiled for this model ({msg})")


class GrammarCache:
    """Compiled grammars by canonical constraint, compiled off the engine thread, LRU-bounded."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                 max_entries: int = DEFAULT_CACHE_ENTRIES):
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.hits = 0
        self.compiles = 0
        # One thread: compiles are tens of ms and the cores belong to the engine.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        # Reading the vocabulary is slow (a pass over every token): start at load, so no
        # request waits for it.
        self._compiler = self._pool.submit(self._make_compiler, tokenizer, vocab_size,
                                           sorted(stop_token_ids))

    @staticmethod
    def _make_compiler(tokenizer, vocab_size: int, stop_token_ids: list[int]):
        xgr = _load_xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
        # Our LRU is the cache (bounded); xgrammar's own would grow without bound.
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def get(self, spec: GuidedSpec) -> Future:
        """The Future of spec's compiled grammar (its exception: a ValueError naming the field)."""
        key = (spec.kind, spec.text)
        with self._lock:
            fut = self._entries.get(key)
            if fut is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return fut
            self.compiles += 1
            fut = self._pool.submit(self._compile, spec)
            self._entries[key] = fut
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            return fut

    def _compile(self, spec: GuidedSpec):
        compiler = self._compiler.result()
        try:
            if spec.kind in ("json", "json_object"):
                # Compact separators (", ", ": "), no free whitespace: a small model left to
                # choose its whitespace can spend max_tokens on indentation and newlines.
                return compiler.compile_json_schema(spec.text or '{"type": "object"}',
                                                    any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            return compiler.compile_grammar(spec.text)
        except Exception as e:
            raise _compile_error(spec, e) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GuidedState:
    """One request's grammar: the compile Future, then its matcher and next-token bitmask."""

    def __init__(self, spec: GuidedSpec, grammar: Future):
        self.spec = spec
        self.grammar = grammar
        self.matcher = None
        self.bitmask: torch.Tensor | None = None  # [1, words] int32: what may come next
        self.complete = False  # nothing but EOS may follow (or EOS was taken)

    @property
    def started(self) -> bool:
        return self.matcher is not None

    def start(self, stop_only: torch.Tensor) -> None:
        """Make the matcher (the Future must be done; its exception propagates)."""
        xgr = _load_xgrammar()
        self.matcher = xgr.GrammarMatcher(self.grammar.result())
        self.bitmask = xgr.allocate_token_bitmask(1, stop_only.shape[-1] * 32)
        self._fill(stop_only)

    def accept(self, token: int, stop_only: torch.Tensor) -> bool:
        """Advance by a sampled token; False if the grammar refuses it (a mask/sampler bug)."""
        if not self.matcher.accept_token(token):
            return False
        if self.matcher.is_terminated():
            self.complete = True
        else:
            self._fill(stop_only)
        return True

    def _fill(self, stop_only: torch.Tensor) -> None:
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        self.complete = torch.equal(self.bitmask[0], stop_only)


class GuidedMasker:
    """The sampler hook and the engine's guided-decoding state: compile cache, masks, EOS."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                 max_entries: int = DEFAULT_CACHE_ENTRIES):
        stop_ids = sorted(set(stop_token_ids))
        self.vocab_size = vocab_size
        self.cache = GrammarCache(tokenizer, vocab_size, stop_ids, max_entries)
        words = (vocab_size + 31) // 32
        # The bitmask of a matcher that may take only EOS: such a request is complete.
        self.stop_only = torch.zeros(words, dtype=torch.int32)
        for t in stop_ids:
            if 0 <= t < vocab_size:
                self.stop_only[t // 32] |= _bit(t % 32)

    def state_for(self, spec: GuidedSpec | None) -> GuidedState | None:
        """A new request's state; its grammar starts compiling now (or is already cached)."""
        return None if spec is None else GuidedState(spec, self.cache.get(spec))

    def start(self, state: GuidedState) -> str | None:
        """Start a state whose compile finished; the error message if it failed."""
        try:
            state.start(self.stop_only)
        except ValueError as e:
            return str(e)
        except Exception as e:  # an xgrammar failure past compile: still this request's alone
            return f"{state.spec.field}: {e}"
        return None

    def accept(self, state: GuidedState, token: int) -> bool:
        return state.accept(token, self.stop_only)

    def apply(self, logits: torch.Tensor, rows: Sequence) -> None:
        """Mask, in place, every row whose sequence carries a started GuidedState."""
        idx = [i for i, r in enumerate(rows) if getattr(r, "guided", None) is not None]
        if idx:
            mask_logits(logits, [rows[i].guided.bitmask for i in idx], idx)

    def close(self) -> None:
        self.cache.close()


def _bit(i: int) -> int:
    """Bit i of an int32 word as a Python int in int32 range (bit 31 is the sign bit)."""
    return -(1 << 31) if i == 31 else 1 << i


def mask_logits(logits: torch.Tensor, bitmasks: list[torch.Tensor], idx: list[int]) -> None:
    """Set logits[idx[j], t] to -inf wherever bitmasks[j] ([1, words] int32) bans token t."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES and _LITTLE_ENDIAN:
        _mask_numpy(logits, bitmasks, idx)
    else:
        _mask_torch(logits, bitmasks, idx)


def _mask_numpy(logits: torch.Tensor, bitmasks: list[torch.Tensor], idx: list[int]) -> None:
    """One thread, no OpenMP region (the module docstring says why and what it costs)."""
    words = [m.numpy() for m in bitmasks]
    masks = words[0] if len(words) == 1 else np.concatenate(words)  # [n, words] int32
    # the inverted bytes unpacked least significant bit first: True = banned, in token order
    banned = np.unpackbits(np.invert(masks.view(np.uint8)), axis=-1,
                           bitorder="little").view(np.bool_)[:, :logits.shape[-1]]
    out = logits.numpy()  # shares logits' memory
    if len(idx) == out.shape[0]:
        np.copyto(out, -np.inf, where=banned)
    else:
        for j, i in enumerate(idx):
            np.copyto(out[i], -np.inf, where=banned[j])


_SHIFTS: dict[torch.device, torch.Tensor] = {}  # 0..31 per device, made once


def _mask_torch(logits: torch.Tensor, bitmasks: list[torch.Tensor], idx: list[int]) -> None:
    dev = logits.device
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    masks = torch.cat(bitmasks).to(dev)  # [n, words] int32
    # bit b of word w allows token 32 * w + b
    banned = ((masks.unsqueeze(-1) >> shifts) & 1).view(len(idx), -1)[:, :logits.shape[-1]] == 0
    if len(idx) == logits.shape[0]:
        logits.masked_fill_(banned, float("-inf"))
    else:
        at = torch.tensor(idx, device=dev)
        logits[at] = logits[at].masked_fill_(banned, float("-inf"))
