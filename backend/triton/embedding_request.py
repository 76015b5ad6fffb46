"""The `embedding_request` input (vllm_backend's contract, which Triton's OpenAI frontend sends
for /v1/embeddings): JSON `{"input": "<text>" | [token ids], "pooling_params": {"dimensions":
[d]}}`; `dimensions` is a one-element list (or absent / null). Pure functions; every error is a
ValueError naming the field as the client wrote it."""
from __future__ import annotations

from dataclasses import dataclass

from backend.engine import json_input

FIELD = "embedding_request"


@dataclass
class EmbeddingInput:
    input: str | list[int]
    dimensions: int | None = None


def parse_embedding_request(text: str) -> EmbeddingInput:
    obj = json_input.loads(FIELD, text)
    if not isinstance(obj, dict):
        raise ValueError(f"{FIELD}: must be a JSON object with \"input\"")
    unknown = set(obj) - {"input", "pooling_params"}
    if unknown:
        raise ValueError(f"{FIELD}: unknown field {sorted(unknown)[0]!r}")
    value = obj.get("input")
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{FIELD}.input: the text is empty")
    elif not (isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise ValueError(f"{FIELD}.input: must be a string or a non-empty list of token ids")
    pooling = obj.get("pooling_params") or {}
    if not isinstance(pooling, dict):
        raise ValueError(f"{FIELD}.pooling_params: must be a JSON object")
    unknown = set(pooling) - {"dimensions"}
    if unknown:
        raise ValueError(f"{FIELD}.pooling_params: unknown field {sorted(unknown)[0]!r}")
    dims = pooling.get("dimensions")
    if isinstance(dims, list):  # the contract's one-element list
        if len(dims) != 1:
            raise ValueError(f"{FIELD}.pooling_params.dimensions: one value in a list, got "
                             f"{len(dims)}")
        dims = dims[0]
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int)):
        raise ValueError(f"{FIELD}.pooling_params.dimensions: must be an integer, got {dims!r}")
    return EmbeddingInput(value, dims)
