"""What the engine hands back: per-step deltas for streaming, whole results for offline use."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend.engine.sampling.logprobs import PositionLogprobs

if TYPE_CHECKING:
    from backend.engine.sequence import Sequence


@dataclass
class RequestOutput:
    """One streaming update of one request: the text and tokens new since the previous update."""
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    num_input_tokens: int
    num_output_tokens: int
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
    invalid: bool = False  # the error is the request's own (a client error), e.g. its grammar
    metrics: dict | None = None  # on the final output: ttft_s, e2e_s, model_s, collective_s
    # One entry per token in token_ids when params.top_logprobs is set, else None.
    logprobs: list[PositionLogprobs] | None = None
    # Parallel sampling (n > 1): each sample's update at its index (text and tokens above empty)
    samples: list["RequestOutput"] | None = None
    index: int = 0  # the sample this update is of (within `samples`)
    embedding: list[float] | None = None  # an embedding request's vector (its one output)

    @staticmethod
    def merged(parts: list["RequestOutput"]) -> "RequestOutput":
        """Consecutive updates of one request as one (a step that accepted draft tokens): texts,
        tokens and logprobs joined; the rest as of the last."""
        out = parts[-1]
        if len(parts) > 1:
            out.text = "".join(p.text for p in parts)
            out.token_ids = [t for p in parts for t in p.token_ids]
            if out.logprobs is not None:
                out.logprobs = [lp for p in parts for lp in p.logprobs or []]
        return out


@dataclass
class CompletionOutput:
    """A finished request, as the offline LLM.generate returns it."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_input_tokens: int
    num_output_tokens: int = 0
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None
    metrics: dict = field(default_factory=dict)  # ttft_s, e2e_s
    logprobs: list[PositionLogprobs] | None = None  # per generated token (params.top_logprobs)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why, when finish_reason is "error" (e.g. a grammar that failed)
    # Parallel sampling (n > 1): the n completions (this object's own text stays empty)
    samples: list["CompletionOutput"] = field(default_factory=list)

    @property
    def outputs(self) -> list["CompletionOutput"]:
        """The request's completions: its n samples, or itself (n = 1)."""
        return self.samples or [self]

    def extend(self, out: RequestOutput) -> None:
        if out.samples is not None:
            if not self.samples:
                self.samples = [CompletionOutput(self.request_id, "", [], None,
                                                 self.num_input_tokens) for _ in out.samples]
            for mine, part in zip(self.samples, out.samples):
                mine.extend(part)
        self.text += out.text
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
        self.token_ids.extend(out.token_ids)
        self.num_output_tokens = out.num_output_tokens
        self.cumulative_logprob = out.cumulative_logprob
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.error = out.error
            self.metrics.update(out.metrics or {})


@dataclass
class EmbeddingOutput:
    """A finished embedding request, as the offline LLM.embed returns it."""
    request_id: str
    embedding: list[float]
    num_input_tokens: int
    num_cached_tokens: int = 0


def output_for(seq: "Sequence", text: str, token_ids: list[int]) -> RequestOutput:
    """seq's update carrying `text` and `token_ids` (new since its previous update)."""
    return RequestOutput(index=seq.index,
        request_id=seq.request_id, text=text, token_ids=token_ids,
        finished=seq.finish_reason is not None, finish_reason=seq.finish_reason,
        num_input_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
        cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs else None,
        stop_reason=seq.stop_reason, num_cached_tokens=seq.num_cached_tokens or 0,
        metrics=_metrics(seq) if seq.finish_reason is not None else None)


def _metrics(seq: "Sequence") -> dict:
    now = time.perf_counter()
    return {"ttft_s": None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            "e2e_s": now - seq.arrival_time, "model_s": seq.model_seconds,
            "collective_s": seq.collective_seconds, "preemptions": seq.num_preemptions}
