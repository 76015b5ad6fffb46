"""Replays the speculative-decoding draft policy over fixed greedy outputs, without the model:
`python -m client bench spec-replay`.

Greedy tokens are the same with speculation on or off, so once a workload's outputs are known,
every draft's fate is known too: a draft is accepted up to the first token that differs from
the output. This module decodes bench speculation's workloads once (one batch each), then
drives `NgramSpeculator` step by step over those outputs as the engine would
(propose, then accept or observe) and weighs each step by the cost of its rows in one-row
steps (`--row-costs`; by default the table this machine's engine measured at warmup, the one
its speculator weighs drafts with: step_cost.py). The ratio of plain steps to that weighted sum
is the decode speedup the policy would give if steps cost what the table says: prefill,
sampling and the VM's drift (5-25% between runs here) left out. Use it to compare draft policies
(sources, priors, decay) on thousands of steps in seconds, then confirm a winner with
`bench speculation`, which measures the real thing.

Two bounds, over the same outputs and costs, say how much any length policy or any copy source
could add: `perfect_lengths` drafts the policy's own candidates (the same sources), each cut to
exactly the tokens the model will accept; `any_copy` drafts, at every step, the longest run of
the coming output (up to k) found anywhere in the context so far, i.e. what a prompt-lookup
drafter that always picked the right place to copy from, and the right length, would get.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from backend.engine.speculation.ngram import NgramIndex, agreeing, copy_from
from backend.engine.sampling.sampling_params import SamplingParams
from backend.engine.sequence import Sequence
from backend.engine.speculation.speculator import CPU_STEP_COST, CPU_VERIFY_ROWS, NgramSpeculator, SpecState, \
    StepCost

@dataclass
class Replay:
    tokens: int = 0  # output tokens: the plain decode's steps
    cost: float = 0.0  # the speculating decode's steps, each weighed by its rows
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def speedup(self) -> float:
        return self.tokens / self.cost if self.cost else 0.0

    def add(self, other: Replay) -> None:
        self.tokens += other.tokens
        self.cost += other.cost
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted


def replay_one(spec: NgramSpeculator, prompt: list[int], output: list[int], max_tokens: int,
               cost: StepCost = CPU_STEP_COST) -> Replay:
    """One request: the first output token comes from the prompt's prefill (no drafts), each
    later step from propose + accept/observe, as LLMEngine runs them."""
    seq = Sequence("replay", list(prompt) + output[:1], len(prompt),
                   SamplingParams(temperature=0.0, max_tokens=max_tokens), 0)
    out = Replay(tokens=len(output) - 1)
    i = 1
    while i < len(output):
        seq.num_computed_tokens = len(seq.token_ids) - 1  # decoding: the last token is new
        spec.propose([seq], waiting=0, max_num_seqs=CPU_VERIFY_ROWS)
        draft = seq.draft_token_ids
        out.steps += 1
        out.cost += cost(1 + len(draft))
        if not draft:
            spec.observe(seq, output[i])
            seq.token_ids.append(output[i])
            i += 1
            continue
        # row j's token is the model's after the first j drafts: output[i + j] while they agree
        sampled = [output[i + j] if i + j < len(output) else -1 for j in range(len(draft) + 1)]
        accepted = spec.accept(seq, sampled)
        out.drafted += len(draft)
        out.accepted += accepted
        seq.draft_token_ids = []
        n = min(accepted + 1, len(output) - i)
        seq.token_ids.extend(output[i:i + n])
        i += n
    return out


def replay(make: Callable[[], NgramSpeculator], work: list[tuple[list[int], list[int]]],
           max_tokens: int, cost: StepCost = CPU_STEP_COST) -> Replay:
    total = Replay()
    for prompt, output in work:
        total.add(replay_one(make(), prompt, output, max_tokens, cost))
    return total


def _all_accepted(work: list[tuple[list[int], list[int]]], cost: StepCost,
                  drafter: Callable[[], Callable[[list[int], list[int]], int]]) -> Replay:
    """Each request decoded by steps whose drafts are all accepted: drafter() gives a request's
    `accepted(context, coming)`, the drafts of a step over `context` that the next tokens
    `coming` confirm (never past the output's last token: the step's own token comes after)."""
    total = Replay()
    for prompt, output in work:
        accepted = drafter()
        context = list(prompt) + output[:1]
        total.tokens += len(output) - 1
        i = 1
        while i < len(output):
            a = accepted(context, output[i:len(output) - 1])
            total.steps += 1
            total.cost += cost(1 + a)
            total.drafted += a
            total.accepted += a
            context.extend(output[i:i + a + 1])
            i += a + 1
    return total


def perfect_lengths(work: list[tuple[list[int], list[int]]], k: int, match: int,
                    cost: StepCost) -> Replay:
    """The speculator's candidates (SpecState: the same sources in the same order), each step
    drafting exactly the part of its candidate that the model accepts."""
    def drafter():
        st = SpecState([NgramIndex(n) for n in range(match, 0, -1)], {})

        def accepted(context: list[int], coming: list[int]) -> int:
            found = st.candidate(context, k)
            a = agreeing(found[1], coming) if found else 0
            st.advanced(a + 1)
            return a
        return accepted
    return _all_accepted(work, cost, drafter)


def _longest_copy(context: list[int], coming: list[int], k: int) -> int:
    """The longest prefix of `coming` (at most k tokens) that some copy from the context drafts
    (ngram.copy_from: a copy runs on into the tokens it drafts)."""
    limit = min(k, len(coming))
    best = 0
    for start, token in enumerate(context):
        if best == limit:
            break
        if token == coming[0]:  # (limit > 0 here: a limit of 0 broke out above)
            best = max(best, agreeing(copy_from(context, start, limit), coming))
    return best


def any_copy(work: list[tuple[list[int], list[int]]], k: int, cost: StepCost) -> Replay:
    """Each step drafts the longest run of the coming output that occurs anywhere earlier in
    the context (up to k tokens), all of it accepted: the bound of drafting by copying."""
    return _all_accepted(work, cost, lambda: lambda context, coming: _longest_copy(context,
                                                                                     coming, k))


def record(llm, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt token ids, greedy output token ids) of each prompt (the same with speculation on
    or off: tests/test_speculation.py)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [(llm.tokenizer.encode(p), list(o.token_ids)) for p, o in zip(prompts, outs)]


def main(args: argparse.Namespace) -> None:
    from backend import LLM
    from client.bench.bench_speculation import _chat, chat_prompts, grounded_prompts
    # speculation on: its warmup measures this machine's verify steps (the recorded outputs are
    # the same as without: greedy tokens are identical either way)
    llm = LLM(model=args.model, num_threads=args.threads, speculative_ngram=args.k,
              speculative_ngram_match=args.match)
    cost = StepCost(tuple(float(c) for c in args.row_costs.split(","))) if args.row_costs \
        else llm.engine.speculator.cost
    tok = llm.tokenizer
    workloads = {"(a) grounded": [_chat(tok, p) for p, _ in grounded_prompts(args.prompts,
                                                                             args.seed)],
                 "(b) chat": [_chat(tok, p) for p, _ in chat_prompts(args.prompts)]}
    t0 = time.perf_counter()
    recorded = {name: record(llm, ps, args.max_tokens) for name, ps in workloads.items()}
    source = "--row-costs" if args.row_costs else "the engine's, measured here at warmup"
    print(f"recorded {sum(len(o) for w in recorded.values() for _, o in w)} output tokens in "
          f"{time.perf_counter() - t0:.0f} s; step costs by rows ({source}) {cost.table}")
    make = lambda: NgramSpeculator(args.k, args.match, CPU_VERIFY_ROWS, cost)  # noqa: E731
    result = {}
    most = min(args.k, CPU_VERIFY_ROWS - 1)  # the bounds draft what a CPU step may verify
    for name, work in recorded.items():
        r = replay(make, work, args.max_tokens, cost)
        lengths = perfect_lengths(work, most, args.match, cost)
        copy = any_copy(work, most, cost)
        result[name] = {"speedup": r.speedup, "steps": r.steps, "plain_steps": r.tokens,
                        "drafted": r.drafted, "accepted": r.accepted,
                        "perfect_lengths_speedup": lengths.speedup,
                        "any_copy_speedup": copy.speedup}
        print(f"{name}: modeled decode speedup {r.speedup:.3f}x, {r.steps} steps for "
              f"{r.tokens} tokens, {r.accepted}/{r.drafted} drafts accepted; bounds: perfect "
              f"lengths {lengths.speedup:.3f}x, any copy {copy.speedup:.3f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"k": args.k, "match": args.match, "seed": args.seed,
                       "step_costs": cost.table, "step_costs_source": source,
                       "recorded": recorded, "result": result}, f)
