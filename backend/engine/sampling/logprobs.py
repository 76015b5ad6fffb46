"""Per-token log probabilities with top-k alternatives (OpenAI's logprobs / top_logprobs).

Computed from the raw logits of the step (log_softmax before penalties, temperature and the
top-k/top-p/min-p filters: the model's own distribution, as OpenAI and vLLM's default report it),
only for the rows whose SamplingParams ask for them (`top_logprobs` not None), so requests that do
not ask pay nothing. `rank` is 1 + the number of tokens strictly more likely than the chosen one
(1 = the argmax), as vLLM reports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class TokenLogprob:
    """One candidate token at one position."""
    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None  # the token's text (filled by the engine, which has the tokenizer)


@dataclass
class PositionLogprobs:
    """One generated position: the chosen token and the `k` most likely tokens (best first)."""
    chosen: TokenLogprob
    top: list[TokenLogprob] = field(default_factory=list)

    def as_vllm_dict(self) -> dict[int, TokenLogprob]:
        """vLLM's shape: token id -> entry, the chosen token included (k or k + 1 entries)."""
        d = {t.token_id: t for t in self.top}
        d.setdefault(self.chosen.token_id, self.chosen)
        return d


def compute(logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[PositionLogprobs]:
    """`logprobs` [R, V]: log_softmax of the raw logits of the R asking rows; `chosen` [R]: their
    sampled ids; `ks`: each row's top_logprobs. One topk at the largest k for all rows."""
    chosen = chosen.to(logprobs.device).unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen)  # [R, 1]
    ranks = (logprobs > chosen_lp).sum(dim=1) + 1
    k_max = min(max(ks), logprobs.shape[1]) if ks else 0
    if k_max > 0:
        top_v, top_i = logprobs.topk(k_max, dim=1)  # sorted, best first
        top_v, top_i = top_v.tolist(), top_i.tolist()
    out = []
    for r, (tok, lp, rank) in enumerate(zip(chosen.squeeze(1).tolist(),
                                            chosen_lp.squeeze(1).tolist(), ranks.tolist())):
        top = [TokenLogprob(int(i), float(v), j + 1)
               for j, (i, v) in enumerate(zip(top_i[r][:ks[r]], top_v[r][:ks[r]]))] \
            if k_max > 0 else []
        out.append(PositionLogprobs(TokenLogprob(int(tok), float(lp), int(rank)), top))
    return out


def decode_tokens(pos: PositionLogprobs, decode: Callable[[list[int]], str]) -> PositionLogprobs:
    """Fills decoded_token (each token's text on its own) for the chosen token and alternatives."""
    for t in (pos.chosen, *pos.top):
        if t.decoded_token is None:
            t.decoded_token = decode([t.token_id])
    return pos
