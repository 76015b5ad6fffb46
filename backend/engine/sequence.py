"""One request's state as it moves through the engine."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from backend.engine.sampling.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then every generated token
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int  # FCFS rank: lower is older and wins when blocks run out
    generator: torch.Generator | None = None
    detokenizer: object | None = None
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    # prefix caching (kv_manager): keys of the full blocks so far, how many of block_table's
    # leading blocks are keyed, prompt tokens served from the cache at first admission
    block_keys: list[bytes] = field(default_factory=list)
    num_keyed_blocks: int = 0
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    model_seconds: float = 0.0  # wall time of the steps this sequence was part of
    collective_seconds: float = 0.0  # ... of which inside tensor-parallel collectives
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    guided: object | None = None  # GuidedState (backend/engine/sampling/guided.py) of a constrained request
    # speculative decoding (speculation.py): this step's draft tokens (computed as extra decode
    # rows, appended only once verified) and the sequence's drafting state (SpecState)
    draft_token_ids: list[int] = field(default_factory=list)
    spec: object | None = None
    lora_id: int = 0  # the LoRA adapter its rows run with (backend/engine/lora.py); 0: none
    # parallel sampling (n > 1, parallel_sampling.py): the request's samples and this one's index
    group: object | None = None
    index: int = 0
    # an embedding request (backend/engine/pooling.py: EmbeddingState): computed, never sampled
    embedding: object | None = None

    @property
    def slots(self) -> int:
        """Sequences it will run as: n for a parallel-sampling request not yet forked, else 1
        (the scheduler keeps the running sequences within max_num_seqs)."""
        return self.group.n if self.group is not None and not self.group.forked else 1

    @property
    def cache_salt(self) -> bytes:
        """What its first prefix-cache key is chained from: the same tokens under another
        adapter hold other K/V, so they never share blocks."""
        return b"lora:%d" % self.lora_id if self.lora_id else b""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_schedulable(self) -> int:
        """Tokens the scheduler may compute now: a constrained request whose grammar is still
        compiling keeps back its last token (the one whose logits are sampled)."""
        n = self.num_uncomputed
        return n - 1 if self.guided is not None and not self.guided.started else n
