"""Turning a request as a client sent it into one the engine can run: the prompt tokenized, every
limit checked (vocabulary, context length, KV cache size, what needs a tokenizer), the grammar
of a structured-output request handed to its compiler. Runs off the engine thread (the Triton
adapter calls it on the request's own thread), so a bad request fails alone, with a ValueError
that names the field, before it can touch the engine's state."""
from __future__ import annotations

from dataclasses import dataclass

from backend.engine.pooling import EmbeddingState, PoolingConfig, check_dimensions
from backend.engine.sampling.guided import GuidedMasker, GuidedState
from backend.engine.kv_manager import KVCacheManager
from backend.engine.sampling.sampling_params import SamplingParams


@dataclass
class PreparedRequest:
    """A validated, tokenized request, ready to enter the engine thread."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    guided: GuidedState | None = None  # its grammar compiles from prepare_request on
    embedding: EmbeddingState | None = None  # an embedding request: pooled, never sampled


def prompt_ids(prompt: str | list[int], tokenizer, vocab_size: int,
               field: str = "text_input") -> list[int]:
    """The prompt's token ids: a string tokenized, a list of ids checked against the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{field}: the prompt is empty")
        if tokenizer is None:
            raise ValueError(f"{field}: this model has no tokenizer; pass token ids")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise ValueError(f"{field}: must be a string or a list of token ids")
    if not ids:
        raise ValueError(f"{field}: the prompt is empty")
    if any(t < 0 or t >= vocab_size for t in ids):
        raise ValueError(f"{field}: token ids must be in [0, {vocab_size})")
    return ids


def check_lengths(n: int, max_tokens: int, max_model_len: int, kv: KVCacheManager) -> None:
    """A prompt of n tokens plus max_tokens must fit the context and the whole KV cache."""
    if n >= max_model_len:
        raise ValueError(f"text_input: the prompt is {n} tokens; the context holds "
                         f"{max_model_len} (prompt + at least one generated token)")
    if n + max_tokens > max_model_len:
        raise ValueError(f"max_tokens: prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
                         f"the context length {max_model_len}; use max_tokens <= "
                         f"{max_model_len - n}")
    if kv.most_blocks_held(n + max_tokens) > kv.num_blocks:
        raise ValueError(f"max_tokens: prompt + max_tokens ({n + max_tokens} tokens) exceeds "
                         f"the KV cache ({kv.num_blocks * kv.block_size} tokens)")


def prepare_request(request_id: str, prompt: str | list[int], params: SamplingParams | None,
                    tokenizer, vocab_size: int, max_model_len: int, kv: KVCacheManager,
                    guided: GuidedMasker | None, max_num_seqs: int | None = None
                    ) -> PreparedRequest:
    """Validate and tokenize; raises ValueError naming the field."""
    params = params or SamplingParams()
    params.validate()
    if max_num_seqs is not None and params.n > max_num_seqs:
        raise ValueError(f"n: at most max_num_seqs ({max_num_seqs}) samples run at once, got "
                         f"{params.n}")
    ids = prompt_ids(prompt, tokenizer, vocab_size)
    check_lengths(len(ids), params.max_tokens, max_model_len, kv)
    if params.stop and tokenizer is None:
        raise ValueError("stop: stop strings need a tokenizer; this model has none")
    spec = params.guided
    if spec is not None and guided is None:
        raise ValueError(f"{spec.field}: structured output needs a tokenizer; this model has none")
    return PreparedRequest(request_id, ids, params,
                           guided.state_for(spec) if spec is not None else None)


def prepare_embedding(request_id: str, prompt: str | list[int], dimensions: int | None,
                      pooling: PoolingConfig, hidden_size: int, tokenizer, vocab_size: int,
                      max_model_len: int, kv: KVCacheManager) -> PreparedRequest:
    """An embedding request: the prompt tokenized and checked against the context and the KV
    cache (it generates nothing), `dimensions` against the hidden size."""
    check_dimensions(dimensions, hidden_size)
    ids = prompt_ids(prompt, tokenizer, vocab_size, "input")
    if len(ids) > max_model_len:
        raise ValueError(f"input: the text is {len(ids)} tokens; the context holds "
                         f"{max_model_len}")
    if kv.most_blocks_held(len(ids)) > kv.num_blocks:
        raise ValueError(f"input: {len(ids)} tokens exceed the KV cache "
                         f"({kv.num_blocks * kv.block_size} tokens)")
    return PreparedRequest(request_id, ids, SamplingParams(max_tokens=1, temperature=0.0),
                           embedding=EmbeddingState(pooling, dimensions))
