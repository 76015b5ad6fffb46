"""`python -m client bench parallel`: parallel sampling (n > 1) against n separate requests of
the same prompt, in the same run.

Each round takes a fresh random prompt of L tokens and runs it twice on one engine, the prefix
cache emptied before each run (neither finds the other's blocks), the order alternating: (n) one
request with `n` samples; (sep) n requests of that prompt submitted at once, each with
`n = 1`. Both sample at temperature 1 with ignore_eos, so both generate n x O tokens. Prefix
caching is on, as served: the separate requests then share the prompt's blocks too, as far as
the scheduler admits them after the first one's blocks are computed (so the two differ by little
more than the prompt's last block); `--no-prefix-caching` runs both without it, where n separate
requests compute the prompt n times. The ratio is the median of the rounds' time(n) /
time(sep) (target <= 0.6: one prefill instead of n).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from backend import LLM, SamplingParams
from client.bench import benchutil as bu

FULL = (8, 512, 32, 5)  # samples, prompt tokens, output tokens, rounds
QUICK = (4, 64, 8, 2)


def _timed(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    return time.perf_counter() - t0, sum(len(o.token_ids) for out in outs for o in out.outputs)


def main(args: argparse.Namespace) -> int:
    n, in_len, out_len, rounds = QUICK if args.quick else FULL
    n, rounds = args.n or n, args.repeats or rounds
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads, max_num_seqs=max(16, n),
              enable_prefix_caching=not args.no_prefix_caching)
    info = bu.run_info(args.threads, args.dtype, str(llm.engine.model_dir))
    vocab = llm.engine.model_config.vocab_size
    res: dict = {"config": dict(vars(args)), "sizes": [n, in_len, out_len], "info": info,
                 "rounds": []}
    for r in range(rounds):
        prompt = bu.make_prompts(1, in_len, vocab, args.seed + r)[0]
        row = {}
        for kind in ("n", "sep") if r % 2 == 0 else ("sep", "n"):
            llm.engine.kv.reset_prefix_cache()  # neither finds the other's prompt blocks
            if kind == "n":
                sp = SamplingParams(n=n, temperature=1.0, seed=r, max_tokens=out_len,
                                    ignore_eos=True)
                row["n_s"], row["n_tokens"] = _timed(llm, [prompt], sp)
            else:
                sp = SamplingParams(temperature=1.0, max_tokens=out_len, ignore_eos=True)
                row["sep_s"], row["sep_tokens"] = _timed(llm, [prompt] * n, sp)
        row["ratio"] = row["n_s"] / row["sep_s"]
        res["rounds"].append(row)
    ratios = [r["ratio"] for r in res["rounds"]]
    res["ratio"] = statistics.median(ratios)
    res["cold_path"] = llm.stats["cold_path"]
    text = report(res)
    res["report"] = text
    path = bu.write_json(args.out or bu.default_out("parallel"), res)
    print(text)
    print(f"\nwrote {path}")
    llm.close()
    return 0


def report(res: dict) -> str:
    n, in_len, out_len = res["sizes"]
    rows = [[str(i), bu.fmt_num(r["n_s"], 2), bu.fmt_num(r["sep_s"], 2), f"{r['ratio']:.2f}",
             f"{r['n_tokens']}/{r['sep_tokens']}"] for i, r in enumerate(res["rounds"])]
    ratios = [r["ratio"] for r in res["rounds"]]
    return "\n".join([
        bu.header_line(res["info"]),
        f"cold-path events after ready: {res['cold_path'] or 0}",
        "",
        bu.table(f"{n} samples of one {in_len}-token prompt, {out_len} tokens each: one request "
                 f"with n={n} vs {n} requests at once (prefix caching "
                 f"{'off' if res['config']['no_prefix_caching'] else 'on'})", ["round", "n s", "separate s",
                                                          "n/separate", "tokens n/sep"], rows),
        "",
        bu.ratio_lines([bu.ratio_row(f"time n={n} / {n} separate (median of {len(ratios)}, "
                                     f"range {min(ratios):.2f}-{max(ratios):.2f})",
                                     statistics.median(ratios), 0.6, False)]),
    ])
