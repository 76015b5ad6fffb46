"""Per-request generation settings and their validation.

Every invalid value raises ``ValueError`` whose message starts with the field name and states the
allowed range, so the Triton adapter can hand it back to the client unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from backend.engine.sampling.guided_spec import GuidedSpec, guided_spec

MAX_SEED = 2**64 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
# every step tests each new token against the list: a huge one would slow the whole batch
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit (and vLLM's default max_logprobs)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    # parallel sampling: n continuations of the prompt, sharing its prefill (at most the
    # engine's max_num_seqs; backend/engine/parallel_sampling.py)
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Per-token logprobs (RequestOutput.logprobs): None = off; k = the chosen token's logprob plus
    # the k most likely tokens at each position (OpenAI's top_logprobs; vLLM's `logprobs=k`).
    top_logprobs: int | None = None
    # Structured output (at most one; backend/engine/sampling/guided_spec.py): the output is constrained,
    # token by token, to match a JSON schema (a dict or its JSON text), a regex, one of a list of
    # strings, an EBNF grammar (xgrammar's dialect), or response_format {"type": "json_object"}
    # (any JSON) / {"type": "json_schema", "json_schema": {"schema": ...}}. The request stops
    # ("stop") when the grammar is complete; max_tokens still caps it ("length": then the output
    # may be incomplete). EOS is allowed only where the grammar may end.
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict | str | None = None
    # the LoRA adapter to run with (one the engine was started with: EngineConfig.lora_modules);
    # None: the base model
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_logprobs is not None:
            self.logprobs = True  # the chosen token's logprob (and the cumulative) come with them
        self.validate()

    @property
    def guided(self) -> GuidedSpec | None:
        """The output constraint, validated and canonical, or None."""
        return guided_spec(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        _int_in("max_tokens", self.max_tokens, 1, None)
        _int_in("n", self.n, 1, None)
        _float_in("temperature", self.temperature, 0.0, None)
        if not (_is_int(self.top_k) and self.top_k >= -1):
            raise ValueError(f"top_k: must be an integer >= 0 (0 or -1 disables), got {self.top_k!r}")
        _float_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _float_in("min_p", self.min_p, 0.0, 1.0)
        _float_in("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)
        if self.repetition_penalty > 10.0:
            raise ValueError(f"repetition_penalty: must be in (0, 10], got {self.repetition_penalty!r}")
        _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _int_in("seed", self.seed, 0, MAX_SEED)
        _int_in("min_tokens", self.min_tokens, 0, None)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop: must be a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not s:
                raise ValueError("stop: empty strings are not allowed")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop: each string at most {MAX_STOP_STRING_CHARS} characters")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: must be a list of non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got "
                             f"{len(self.stop_token_ids)}")
        if self.top_logprobs is not None:
            _int_in("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        for name in ("ignore_eos", "logprobs", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a boolean, got {getattr(self, name)!r}")
        if self.lora_name is not None and (not isinstance(self.lora_name, str)
                                           or not self.lora_name.strip()):
            raise ValueError(f"lora_name: must be a non-empty string, got {self.lora_name!r}")
        guided_spec(self)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_in(name: str, v: object, low: int, high: int | None) -> None:
    if not _is_int(v):
        raise ValueError(f"{name}: must be an integer, got {v!r}")
    if v < low or (high is not None and v > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}: must be {rng}, got {v}")


def _float_in(name: str, v: object, low: float, high: float | None, low_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name}: must be a number, got {v!r}")
    ok = math.isfinite(v) and (v > low if low_open else v >= low) and (high is None or v <= high)
    if not ok:
        lo = f"({low}" if low_open else f"[{low}"
        rng = f"{lo}, {high}]" if high is not None else f"{'>' if low_open else '>='} {low} and finite"
        raise ValueError(f"{name}: must be {rng}, got {v}")
