"""`python -m client bench tp`: does tensor parallelism pay at low concurrency? (seed 000)

For each layout (TP degree x threads per rank) the same requests run offline: `concurrency`
requests of `input_len` tokens submitted together, each producing exactly `output_len` tokens.
Reported per layout: TTFT, time per output token, end-to-end, and how the engine's model time
splits between compute and tensor-parallel collectives (rank 0's view: waiting for a slower peer
counts as collective time), plus collectives per step and microseconds per call.

The layouts run interleaved: each one is loaded once in its own process (bench_layouts), then
every round runs each layout once on the same prompts, in an order that rotates by round. On a
shared machine whose speed drifts by ~10% over minutes, running the layouts one after another
put the drift into their ratio; interleaved, each round gives a paired ratio and the report shows
their median and range.
"""
from __future__ import annotations

import argparse
import os

from client.bench import benchutil as bu
from client.bench.bench_layouts import Layout, OfflineLayout, interleave, paired_ratios


def _layouts(tps: list[int], threads: str, transports: list[str]) -> list[Layout]:
    """Default: every TP with 1 thread per rank, plus TP1 using all cores — the comparison the
    seed is about on a small machine. TP > 1 runs once per transport."""
    if threads != "auto":
        pairs = [(tp, int(t)) for tp in tps for t in threads.split(",")]
    else:
        cores = os.cpu_count() or 1
        pairs = [(tp, 1) for tp in tps]
        if 1 in tps and cores > 1:
            pairs.insert(1, (1, cores))
    return [Layout(tp, t, transport) for tp, t in pairs
            for transport in (transports if tp > 1 else ["shm"])]


def run_offline(args, layout: Layout, r: int, llm) -> list[dict]:
    """Round r of one layout, in its own process (OfflineLayout): one request per prompt."""
    from backend import SamplingParams
    vocab = llm.engine.model_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    seed = args.seed + 99 if r < 0 else args.seed + r  # r = -1: the uncounted first request
    prompts = bu.make_prompts(args.concurrency, args.input_len, vocab, seed=seed)
    comm = llm.engine.group.comm if llm.engine.group else None
    before, calls0 = llm.stats, comm.calls if comm else 0
    outs = llm.generate(prompts, sp)
    steps = llm.stats["steps"] - before["steps"]
    runs = []
    for o in outs:
        m = o.metrics
        runs.append({
            "round": r, "ttft_s": m["ttft_s"], "e2e_s": m["e2e_s"],
            "tpot_s": (m["e2e_s"] - m["ttft_s"]) / max(1, args.output_len - 1),
            "model_s": m["model_s"], "collective_s": m["collective_s"],
            "collective_calls_per_step": ((comm.calls - calls0) / steps) if comm else 0})
    return runs


def report(info: dict, results: list[dict], ratios: dict, args) -> str:
    rows = []
    for r in results:
        coll, model = r["collective_s"]["median"], r["model_s"]["median"]
        calls = r["collective_calls_per_step"]["median"]
        per_call = 1e6 * coll / max(1.0, calls * (args.output_len + 1))
        rows.append([Layout.of(r).label,
                     bu.fmt_spread(r["ttft_s"], 1e3), bu.fmt_spread(r["tpot_s"], 1e3),
                     bu.fmt_spread(r["e2e_s"], 1e3), f"{100 * coll / model:.0f}%",
                     f"{calls:.0f}", f"{per_call:.1f}"])
    title = (f"concurrency {args.concurrency}, {args.input_len} in / {args.output_len} out, "
             f"{args.repeats} interleaved rounds (median [min-max] over requests)")
    text = [bu.header_line(info), "", bu.table(
        title, ["layout", "TTFT ms", "TPOT ms", "e2e ms", "in collectives", "calls/step",
                "us/call"], rows)]
    text += ratio_text(ratios)
    return "\n".join(text)


def ratio_text(ratios: dict) -> list[str]:
    """The seed's two comparisons, paired per round: median [min-max] over rounds."""
    targets = {"TP2x1/TP1x1": "target <= 0.6", "TP2x1/TP1x2": "target < 1"}
    lines = [""] if ratios else []
    for name, s in ratios.items():
        lines.append(f"  {name} e2e, per round: {bu.fmt_spread(s, digits=2)} "
                     f"({targets.get(name, '')})")
    return lines


def main(args: argparse.Namespace) -> int:
    tps = [int(t) for t in args.tp.split(",")]
    layouts = _layouts(tps, args.threads_per_rank, args.transports.split(","))
    # threads: each layout's own (TP x threads per rank in its label)
    info = bu.run_info("per layout", args.dtype, str(args.model or "embedded default"))
    runners = [OfflineLayout(layout, args, run_offline) for layout in layouts]
    results = interleave(runners, args.repeats)
    ratios = paired_ratios(results, "e2e_s")
    text = report(info, results, ratios, args)
    print(text)
    served, served_ratios = [], {}
    if args.server:
        from client.bench import bench_tp_server
        served = bench_tp_server.run(args, [la for la in layouts if la.transport == "shm"])
        served_ratios = paired_ratios(served, "e2e_s")
        served_text = bench_tp_server.report(info, served, args) + "\n".join(
            ratio_text(served_ratios))
        print("\n" + served_text)
        text += "\n\n" + served_text
    path = bu.write_json(args.out or bu.default_out("tp"),
                         {"info": info, "args": vars(args), "results": results,
                          "ratios": ratios, "served": served, "served_ratios": served_ratios,
                          "report": text})
    print(f"\nwrote {path}")
    return 0
