"""`python -m client bench structured`: structured output (guided_json) beside the same requests
unconstrained, in one run.

(a) N requests (random-token prompts of L tokens, a 10-field JSON schema, up to M output tokens)
submitted at once, constrained and unconstrained alternating for R rounds: output tok/s and the
time of a full-batch decode step (every row sampling: the same step shape in both systems).
(b) one request at a time: time per output token, constrained vs not.
(c) time to first token of a request whose schema is new (compiled for it) vs cached. Every (c)
request has its own fresh random prompt of L tokens (bu.make_prompts, its own seed), as a user's
new request would: with one prompt reused, prefix caching made every prompt after the first a
cache hit and the TTFT one decode step, which a compile longer than that step exceeds. A fresh
prompt is prefilled while its grammar compiles (by design), so (c) is what a new schema costs
a user.
The engine is stepped here, so each step is timed with its number of sampled rows.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from backend import LLM, SamplingParams
from client.bench import benchutil as bu

FULL = (64, 256, 128)  # requests, prompt tokens, max output tokens
QUICK = (8, 32, 32)


def schema(tag: str = "") -> dict:
    """A 10-field object: strings, bounded numbers, an enum, a boolean, an array. `tag` renames
    one field, making a schema the compile cache has not seen."""
    s = {"type": "string", "maxLength": 24}
    props = {"name": s, "city": s, "email": s, "age": {"type": "integer", "minimum": 0,
                                                      "maximum": 120},
             "score": {"type": "number", "minimum": 0, "maximum": 100},
             "member": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]},
             "tags": {"type": "array", "items": s, "maxItems": 3}, "country": s, "note": s}
    if tag:
        props[f"note_{tag}"] = props.pop("note")
    return {"type": "object", "properties": props, "required": list(props)}


def run_batch(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """All requests at once; every step timed with its sampled-row count."""
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"b{time.monotonic_ns()}-{i}", p, sp)
    steps: list[tuple[int, float]] = []
    tokens, finals = 0, []
    t0 = time.perf_counter()
    while eng.has_unfinished():
        s0 = time.perf_counter()
        outs = eng.step()
        steps.append((sum(1 for o in outs if o.token_ids), time.perf_counter() - s0))
        tokens += sum(len(o.token_ids) for o in outs)
        finals += [o for o in outs if o.finished]
    wall = time.perf_counter() - t0
    full = [dt for n, dt in steps if n == len(prompts)]
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "full_batch_step_s": statistics.median(full) if full else None,
            "full_batch_steps": len(full),
            "finish_reasons": {r: sum(o.finish_reason == r for o in finals)
                               for r in {o.finish_reason for o in finals}}}


def run_single(llm: LLM, prompt: list[int], sp: SamplingParams) -> dict:
    out = llm.generate([prompt], sp)[0]
    m = out.metrics
    n = out.num_output_tokens
    return {"ttft_s": m["ttft_s"], "tpot_s": (m["e2e_s"] - m["ttft_s"]) / max(1, n - 1),
            "output_tokens": n}


def main(args: argparse.Namespace) -> int:
    n, in_len, out_len = QUICK if args.quick else FULL
    n = args.requests or n
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads,
              max_num_seqs=max(64, n))
    info = bu.run_info(args.threads, args.dtype, str(llm.engine.model_dir))
    vocab = llm.engine.model_config.vocab_size
    prompts = bu.make_prompts(n, in_len, vocab, args.seed)
    # (c): one fresh prompt per request (another seed: no block shared with prompts or each other)
    fresh = iter(bu.make_prompts(2 * args.repeats, in_len, vocab, args.seed + 1))
    free = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    guided = SamplingParams(temperature=0, max_tokens=out_len, guided_json=schema())
    llm.generate([prompts[0]], guided)  # compile the schema once: (a) and (b) measure decoding

    res: dict = {"config": dict(vars(args)), "sizes": [n, in_len, out_len], "info": info,
                 "a": {"free": [], "guided": []}, "b": {"free": [], "guided": []},
                 "c": {"new": [], "cached": []}}
    for r in range(args.repeats):  # interleaved, order alternating per round
        order = ("free", "guided") if r % 2 == 0 else ("guided", "free")
        for kind in order:
            sp = free if kind == "free" else guided
            res["a"][kind].append(run_batch(llm, prompts, [sp] * n))
            res["b"][kind].append(run_single(llm, prompts[1 % n], sp))
        for kind in ("new", "cached") if r % 2 == 0 else ("cached", "new"):
            tag = f"r{r}_{time.monotonic_ns()}" if kind == "new" else ""
            sp = SamplingParams(temperature=0, max_tokens=4, guided_json=schema(tag))
            res["c"][kind].append(run_single(llm, next(fresh), sp)["ttft_s"])
    res["cold_path"] = llm.stats["cold_path"]
    res["ratios"] = _ratios(res)
    text = report(res)
    res["report"] = text
    out = args.out or bu.default_out("structured")
    path = bu.write_json(out, res)
    print(text)
    print(f"\nwrote {path}")
    return 0


def _med(runs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in runs if r[key] is not None]
    return statistics.median(xs) if xs else None


def _ratios(res: dict) -> list[dict]:
    a, b, c = res["a"], res["b"], res["c"]
    step = (_med(a["free"], "full_batch_step_s"), _med(a["guided"], "full_batch_step_s"))
    return [
        bu.ratio_row(f"(a) output tok/s guided/free, batch {res['sizes'][0]}",
                     _med(a["guided"], "output_tok_s") / _med(a["free"], "output_tok_s"),
                     0.9, True),
        bu.ratio_row("(a) full-batch step time free/guided",
                     step[0] / step[1] if None not in step else None, 0.9, True),
        bu.ratio_row("(b) time per token free/guided, batch 1",
                     _med(b["free"], "tpot_s") / _med(b["guided"], "tpot_s"), 0.95, True),
        bu.ratio_row("(c) TTFT new schema/cached schema",
                     statistics.median(c["new"]) / statistics.median(c["cached"]), 1.2, False),
    ]


def report(res: dict) -> str:
    n, in_len, out_len = res["sizes"]
    rows_a = []
    for kind in ("free", "guided"):
        runs = res["a"][kind]
        step = _med(runs, "full_batch_step_s")
        rows_a.append([kind, bu.fmt_num(_med(runs, "wall_s"), 2),
                       str(int(_med(runs, "output_tokens"))), bu.fmt_num(_med(runs, "output_tok_s")),
                       bu.fmt_num(step * 1e3 if step else None), str(runs[-1]["finish_reasons"])])
    rows_b = [[k, bu.fmt_num(_med(res["b"][k], "tpot_s") * 1e3, 2),
               bu.fmt_num(_med(res["b"][k], "ttft_s") * 1e3)] for k in ("free", "guided")]
    rows_c = [[k, bu.fmt_num(statistics.median(res["c"][k]) * 1e3)] for k in ("new", "cached")]
    return "\n".join([
        bu.header_line(res["info"]),
        f"cold-path events after ready: {res['cold_path'] or 0}",
        "",
        bu.table(f"(a) {n} requests x {in_len} in / up to {out_len} out, at once, median of "
                 f"{len(res['a']['free'])} interleaved rounds (free: ignore_eos, all {out_len})",
                 ["", "wall s", "out tokens", "output tok/s", "full-batch step ms",
                  "finish (last round)"], rows_a),
        "",
        bu.table("(b) one request at a time", ["", "ms/token", "TTFT ms"], rows_b),
        "",
        bu.table(f"(c) TTFT, batch 1, a fresh {in_len}-token prompt each, 4 tokens",
                 ["schema", "TTFT ms"], rows_c),
        "",
        "targets:",
        bu.ratio_lines(res["ratios"]),
    ])
