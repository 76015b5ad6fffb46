"""Per-request response state: engine RequestOutput deltas -> Triton output tensors (numpy).

Pure (no Triton import): the adapter wraps the returned dicts into pb_utils tensors.
Streaming sends each non-empty text delta; non-streaming sends one response at the end, with the
prompt prepended unless exclude_input_in_output (the TensorRT-LLM / vLLM backend convention). A
stream with exclude_input_in_output given as false carries the prompt on its first response
(OpenAI's `echo`). The optional outputs follow vllm_backend's rules (its
ci/L0_additional_outputs_vllm test): each is sent only when its return_* flag is true, then on
every response; a non-final finish_reason is the string "None"; num_input_tokens and
num_output_tokens are UINT32, num_output_tokens counting the tokens new on that response.

Parallel sampling (n > 1), as vllm_backend lays it out: text_output, finish_reason,
cumulative_logprob, logprobs and num_output_tokens hold one element per sample, in sample order
(a sample with nothing new has an empty delta; a sample's finish_reason is "None" until it ends);
num_input_tokens and num_cached_tokens stay one element (the prompt's).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np

from backend.engine.outputs import RequestOutput
from backend.triton.request import ParsedRequest



@dataclass
class StreamState:
    request_id: str
    req: ParsedRequest
    sender: object  # pb_utils.InferenceResponseSender (opaque here)
    arrival: float = field(default_factory=time.perf_counter)
    requested: frozenset | None = None  # requested output names (None = all)
    text: list[str] = field(default_factory=list)  # non-streaming accumulation
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0
    cancelled: bool = False
    abort_error: str | None = None  # set when the server aborts it (shutdown)
    last_cancel_check: float = 0.0
    # Tokens generated but not yet reported on a sent response (streaming skips empty text
    # deltas; non-streaming sends once): their logprobs, and how many tokens were reported.
    pending_logprobs: list = field(default_factory=list)
    reported_output_tokens: int = 0
    sent_text: bool = False  # a response with text went out (the streamed echo goes first)
    samples: list["SampleStream"] | None = None  # n > 1: each sample's own progress


@dataclass
class SampleStream:
    """What one sample of an n > 1 request has accumulated and reported."""
    text: list[str] = field(default_factory=list)
    pending_logprobs: list = field(default_factory=list)
    reported_output_tokens: int = 0


def _bytes(s: str) -> np.ndarray:
    return np.array([s.encode("utf-8")], dtype=object)


def _fields(state: StreamState, out: RequestOutput, final: bool) -> dict:
    d = {}
    for name in ("finish_reason", "num_input_tokens", "num_output_tokens", "cumulative_logprob",
                 "num_cached_tokens"):
        if not state.req.returns.get(name) or (
                state.requested is not None and name not in state.requested):
            continue
        if name == "finish_reason":  # vLLM's str(None) until the request ends
            d[name] = _bytes((out.finish_reason or "None") if final else "None")
        elif name == "cumulative_logprob":
            if out.cumulative_logprob is not None:
                d[name] = np.array([out.cumulative_logprob], dtype=np.float32)
        elif name == "num_output_tokens":
            # the tokens since the previous response, so a client (the OpenAI frontend's
            # streaming usage) sums them; a non-streaming reply carries the total
            d[name] = np.array([out.num_output_tokens - state.reported_output_tokens], np.uint32)
        elif name == "num_input_tokens":
            d[name] = np.array([out.num_input_tokens], dtype=np.uint32)
        else:
            d[name] = np.array([getattr(out, name)], dtype=np.int32)
    return d


def _logprobs_field(state: StreamState) -> dict:
    """The `logprobs` output (return_logprobs): JSON, one object per token of this response,
    token id -> {"logprob", "rank", "decoded_token"} for the chosen token and the top k (the
    vLLM backend's format, which Triton's OpenAI frontend reads)."""
    if not state.req.returns.get("logprobs") or (
            state.requested is not None and "logprobs" not in state.requested):
        return {}
    return {"logprobs": _bytes(_logprobs_json(state.req, state.pending_logprobs))}


def _logprobs_json(req: ParsedRequest, positions: list) -> str:
    if req.params.top_logprobs is None:  # no k in sampling_parameters: vLLM sends null
        return "null"
    return json.dumps([{str(tid): {"logprob": t.logprob, "rank": t.rank,
                                   "decoded_token": t.decoded_token}
                        for tid, t in pos.as_vllm_dict().items()} for pos in positions])


def tensors_for(state: StreamState, out: RequestOutput) -> dict | None:
    """The output tensors to send for `out`, or None when nothing is due (an empty streaming
    delta, or a non-streaming request that has not finished)."""
    if out.samples is not None:
        return _sample_tensors(state, out)
    if out.embedding is not None:  # one response: the vector as a JSON list of floats
        d = {"text_output": _bytes(json.dumps(out.embedding))}
        if _wanted(state, "num_input_tokens"):
            d["num_input_tokens"] = np.array([out.num_input_tokens], dtype=np.uint32)
        if _wanted(state, "num_output_tokens"):
            d["num_output_tokens"] = np.array([0], dtype=np.uint32)
        return d
    final = out.finished
    if out.logprobs:
        state.pending_logprobs.extend(out.logprobs)
    if not state.req.stream:
        state.text.append(out.text)
        if not final:
            return None
        text = "".join(state.text)
        if not state.req.exclude_input_in_output and not state.req.chat:
            text = state.req.prompt + text
    else:
        text = out.text
        if not text and not final:
            return None
        if (not state.sent_text and state.req.exclude_input_in_output is False
                and not state.req.chat):
            text = state.req.prompt + text
    state.sent_text = state.sent_text or bool(text)
    d = {"text_output": _bytes(text)}
    d.update(_fields(state, out, final))
    d.update(_logprobs_field(state))
    state.pending_logprobs = []
    state.reported_output_tokens = out.num_output_tokens
    return d


def record_tokens(state: StreamState, out: RequestOutput, now: float) -> float | None:
    """Updates the token timing of `state`; returns the TTFT when `out` brings the first token."""
    if out.num_output_tokens <= state.num_output_tokens:
        return None
    state.num_output_tokens = out.num_output_tokens
    state.last_token_time = now
    if state.first_token_time is None:
        state.first_token_time = now
        return now - state.arrival
    return None


def mean_itl(state: StreamState) -> float | None:
    """The request's mean inter-token latency (genai-perf's definition), None below 2 tokens."""
    if state.first_token_time is None or state.num_output_tokens < 2:
        return None
    return (state.last_token_time - state.first_token_time) / (state.num_output_tokens - 1)


def _wanted(state: StreamState, name: str) -> bool:
    return bool(state.req.returns.get(name)) and (
        state.requested is None or name in state.requested)


def _sample_tensors(state: StreamState, out: RequestOutput) -> dict | None:
    """tensors_for an n > 1 request: every output one element per sample."""
    if state.samples is None:
        state.samples = [SampleStream() for _ in out.samples]
    final, req = out.finished, state.req
    for mine, part in zip(state.samples, out.samples):
        mine.text.append(part.text)
        mine.pending_logprobs.extend(part.logprobs or [])
    if not req.stream and not final:
        return None
    if req.stream and not final and not any(part.text for part in out.samples):
        return None
    echo = not req.chat and (not req.exclude_input_in_output if not req.stream
                             else req.exclude_input_in_output is False and not state.sent_text)
    texts = [(req.prompt if echo else "") + "".join(m.text) for m in state.samples]
    state.sent_text = True
    for m in state.samples:
        m.text = []
    d = {"text_output": np.array([t.encode("utf-8") for t in texts], dtype=object)}
    if _wanted(state, "finish_reason"):
        d["finish_reason"] = np.array([(p.finish_reason or "None").encode("utf-8")
                                       if p.finished else b"None" for p in out.samples],
                                      dtype=object)
    if _wanted(state, "num_input_tokens"):
        d["num_input_tokens"] = np.array([out.num_input_tokens], dtype=np.uint32)
    if _wanted(state, "num_output_tokens"):
        d["num_output_tokens"] = np.array(
            [p.num_output_tokens - m.reported_output_tokens
             for p, m in zip(out.samples, state.samples)], dtype=np.uint32)
    if _wanted(state, "cumulative_logprob") and out.samples[0].cumulative_logprob is not None:
        d["cumulative_logprob"] = np.array([p.cumulative_logprob for p in out.samples],
                                           dtype=np.float32)
    if _wanted(state, "num_cached_tokens"):
        d["num_cached_tokens"] = np.array([out.num_cached_tokens], dtype=np.int32)
    if _wanted(state, "logprobs"):
        d["logprobs"] = np.array([_logprobs_json(req, m.pending_logprobs).encode("utf-8")
                                  for m in state.samples], dtype=object)
    for p, m in zip(out.samples, state.samples):
        m.pending_logprobs = []
        m.reported_output_tokens = p.num_output_tokens
    state.reported_output_tokens = out.num_output_tokens
    return d
