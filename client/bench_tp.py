"""`python -m client bench tp`: does tensor parallelism pay at low concurrency? (seed 000)

For each layout (TP degree x threads per rank) the same requests run offline: `concurrency`
requests of `input_len` tokens submitted together, each producing exactly `output_len` tokens,
repeated. Reported per layout: TTFT, time per output token, end-to-end, and how the engine's
model time splits between compute and tensor-parallel collectives (rank 0's view: waiting for a
slower peer counts as collective time), plus collectives per step and microseconds per call.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics

from backend import LLM, SamplingParams
from client import benchutil as bu


def _layouts(tps: list[int], threads: str) -> list[tuple[int, int]]:
    """(tp, threads per rank). Default: every TP with 1 thread per rank, plus TP1 using all cores
    — the comparison the seed is about on a small machine."""
    if threads != "auto":
        return [(tp, int(t)) for tp in tps for t in threads.split(",")]
    cores = os.cpu_count() or 1
    out = [(tp, 1) for tp in tps]
    if 1 in tps and cores > 1:
        out.insert(1, (1, cores))
    return out


def run_layout(args, tp: int, threads: int, transport: str = "shm") -> dict:
    os.environ["TPLLM_TP_TRANSPORT"] = transport  # read by the group (workers inherit it)
    llm = LLM(model=args.model, dtype=args.dtype, tensor_parallel_size=tp, num_threads=threads,
              pin_cpus=args.pin, max_num_batched_tokens=max(2048, args.input_len),
              kv_cache_memory_gb=1.0)
    try:
        vocab = llm.engine.model_config.vocab_size
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        warm = bu.make_prompts(args.concurrency, args.input_len, vocab, seed=args.seed + 99)
        llm.generate(warm, sp)  # first request: not counted
        comm = llm.engine.group.comm if llm.engine.group else None
        runs = []
        for r in range(args.repeats):
            prompts = bu.make_prompts(args.concurrency, args.input_len, vocab, seed=args.seed + r)
            before = llm.stats
            calls0 = comm.calls if comm else 0
            outs = llm.generate(prompts, sp)
            after = llm.stats
            steps = after["steps"] - before["steps"]
            for o in outs:
                m = o.metrics
                runs.append({
                    "ttft_s": m["ttft_s"], "e2e_s": m["e2e_s"],
                    "tpot_s": (m["e2e_s"] - m["ttft_s"]) / max(1, args.output_len - 1),
                    "model_s": m["model_s"], "collective_s": m["collective_s"],
                    "collective_calls_per_step": ((comm.calls - calls0) / steps) if comm else 0})
        return {"tp": tp, "threads_per_rank": threads, "transport": transport, "runs": runs,
                **{k: bu.summarize([r[k] for r in runs]) for k in runs[0]}}
    finally:
        llm.close()
        del llm
        gc.collect()


def report(info: dict, results: list[dict], args) -> str:
    rows = []
    for r in results:
        coll, model = r["collective_s"]["median"], r["model_s"]["median"]
        calls = r["collective_calls_per_step"]["median"]
        per_call = 1e6 * coll / max(1.0, calls * (args.output_len + 1))
        label = f"TP{r['tp']} x {r['threads_per_rank']} thr"
        if r["tp"] > 1 and r.get("transport", "shm") != "shm":
            label += f" ({r['transport']})"
        rows.append([label,
                     bu.fmt_spread(r["ttft_s"], 1e3), bu.fmt_spread(r["tpot_s"], 1e3),
                     bu.fmt_spread(r["e2e_s"], 1e3), f"{100 * coll / model:.0f}%",
                     f"{calls:.0f}", f"{per_call:.1f}"])
    title = (f"concurrency {args.concurrency}, {args.input_len} in / {args.output_len} out, "
             f"{args.repeats} repeats (median [min-max] over requests)")
    text = [bu.header_line(info), "", bu.table(
        title, ["layout", "TTFT ms", "TPOT ms", "e2e ms", "in collectives", "calls/step",
                "us/call"], rows)]
    by = {(r["tp"], r["threads_per_rank"]): r["e2e_s"]["median"] for r in results
          if r.get("transport", "shm") == "shm"}
    if (1, 1) in by and (2, 1) in by:
        text.append(f"\n  TP2x1 / TP1x1 e2e: {by[(2, 1)] / by[(1, 1)]:.2f} (target <= 0.6)")
    if (1, 2) in by and (2, 1) in by:
        text.append(f"  TP2x1 / TP1x2 e2e: {by[(2, 1)] / by[(1, 2)]:.2f} (target < 1)")
    return "\n".join(text)


def main(args: argparse.Namespace) -> int:
    tps = [int(t) for t in args.tp.split(",")]
    results = []
    info = None
    transports = args.transports.split(",")
    for tp, threads in _layouts(tps, args.threads_per_rank):
        for transport in (transports if tp > 1 else ["shm"]):
            print(f"running TP{tp} x {threads} thread(s) per rank ({transport}) ...", flush=True)
            results.append(run_layout(args, tp, threads, transport))
            info = info or bu.run_info(threads, args.dtype, str(args.model or "embedded default"))
    os.environ.pop("TPLLM_TP_TRANSPORT", None)
    text = report(info, results, args)
    print(text)
    served = []
    if args.server:
        from transformers import AutoTokenizer

        from backend.engine.llm_engine import resolve_model_dir
        from client import bench_tp_server
        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.model)))
        for tp, threads in _layouts(tps, args.threads_per_rank):
            print(f"serving TP{tp} x {threads} thread(s) per rank ...", flush=True)
            served.append(bench_tp_server.run_layout(args, tp, threads, tokenizer))
        served_text = bench_tp_server.report(info, served, args)
        print("\n" + served_text)
        text += "\n\n" + served_text
    path = bu.write_json(args.out or bu.default_out("tp"),
                         {"info": info, "args": vars(args), "results": results,
                          "served": served, "report": text})
    print(f"\nwrote {path}")
    return 0
