"""The offline API: LLM(...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from backend.engine.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.engine.outputs import CompletionOutput, EmbeddingOutput
from backend.engine.sampling.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Loads the model (the embedded SmolLM2-135M-Instruct when `model` is None) and generates."""

    def __init__(self, model: str | None = None, dtype: str = "float32",
                 tensor_parallel_size: int = 1, num_threads: int | None = None, **kwargs):
        self.config = EngineConfig(model=model, dtype=dtype,
                                   tensor_parallel_size=tensor_parallel_size,
                                   num_threads=num_threads, **kwargs)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def stats(self) -> dict:
        return {**self.engine.stats.snapshot(), "cold_path": self.engine.cold_path.snapshot()}

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        """Runs all prompts together (continuous batching) and returns results in input order.
        A single prompt may be a string or a list of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params: need one per prompt")
        prepared = [self.engine.prepare_request(str(next(self._ids)), p, sp)
                    for p, sp in zip(prompts, sampling_params)]
        results: dict[str, CompletionOutput] = {}
        for req in prepared:
            self.engine.add_request(req.request_id, req)
            results[req.request_id] = CompletionOutput(req.request_id, "", [], None,
                                                       len(req.prompt_token_ids))
        while self.engine.has_unfinished():
            for out in self.engine.step():
                results[out.request_id].extend(out)
        return [results[r.request_id] for r in prepared]

    def embed(self, prompts: Prompt | Seq[Prompt], dimensions: int | None = None
              ) -> list[EmbeddingOutput]:
        """One embedding per prompt (the checkpoint's pooling: backend/engine/pooling.py), run
        together in the engine's batches; `dimensions`: the first d values, renormalized."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prepared = [self.engine.prepare_embedding(str(next(self._ids)), p, dimensions)
                    for p in prompts]
        results: dict[str, EmbeddingOutput] = {}
        for req in prepared:
            self.engine.add_request(req.request_id, req)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.error is not None:
                    raise RuntimeError(f"embedding failed: {out.error}")
                results[out.request_id] = EmbeddingOutput(out.request_id, out.embedding,
                                                          out.num_input_tokens,
                                                          out.num_cached_tokens)
        return [results[r.request_id] for r in prepared]

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
