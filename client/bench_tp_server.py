"""`python -m client bench tp --server`: the TP layouts through the real Triton server.

Per layout a fresh server (python -m backend.serve on free ports, a temporary copy of
model_repository/ with tensor_parallel_size and num_threads set) serves the same kind of
requests as the offline bench: `concurrency` prompts of `input_len` tokens sent at once over one
gRPC stream, each generating exactly `output_len` tokens, repeated. The collective share comes
from the server's own metrics (llm_collective_seconds_total / llm_model_seconds_total).
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from client import benchutil as bu
from client.serve_overhead import make_prompts, run_server
from client.server import Server, make_repo


def run_layout(args, tp: int, threads: int, tokenizer) -> dict:
    params = {"tensor_parallel_size": str(tp), "num_threads": str(threads), "dtype": args.dtype,
              "max_num_batched_tokens": str(max(2048, args.input_len)),
              "kv_cache_memory_gb": "1.0"}
    if args.model:
        params["model"] = str(Path(args.model).resolve())
    with tempfile.TemporaryDirectory(prefix="tpllm-bench-tp-") as d:
        srv = Server(make_repo(Path(d) / "repo", params), Path(d) / "server.log")
        try:
            srv.wait_ready()
            warm = make_prompts(tokenizer, args.concurrency, args.input_len)
            run_server(srv.grpc_url, "llm", warm, args.output_len)  # first requests: not counted
            runs = []
            for r in range(args.repeats):
                prompts = [f"{r} {p}" for p in make_prompts(tokenizer, args.concurrency,
                                                          args.input_len - 2)]
                model0 = srv.metric("llm_model_seconds_total")
                coll0 = srv.metric("llm_collective_seconds_total")
                res = run_server(srv.grpc_url, "llm", prompts, args.output_len)
                srv.wait_metric("llm_model_seconds_total", lambda v: v > model0, timeout=2.0)
                model = srv.metric("llm_model_seconds_total") - model0
                coll = srv.metric("llm_collective_seconds_total") - coll0
                runs.append({"ttft_s": res["mean_ttft_ms"] / 1e3, "tpot_s": res["mean_itl_ms"] / 1e3,
                             "e2e_s": res["wall_s"], "collective_share": coll / model if model else 0.0})
        finally:
            srv.stop()
    return {"tp": tp, "threads_per_rank": threads, "runs": runs,
            **{k: bu.summarize([r[k] for r in runs]) for k in runs[0]}}


def report(info: dict, results: list[dict], args) -> str:
    rows = [[f"TP{r['tp']} x {r['threads_per_rank']} thr", bu.fmt_spread(r["ttft_s"], 1e3),
             bu.fmt_spread(r["tpot_s"], 1e3), bu.fmt_spread(r["e2e_s"], 1e3),
             f"{100 * statistics.median(x['collective_share'] for x in r['runs']):.0f}%"]
            for r in results]
    title = (f"through tritonserver (gRPC streaming): concurrency {args.concurrency}, "
             f"{args.input_len} in / {args.output_len} out, {args.repeats} repeats "
             f"(median [min-max] over repeats)")
    return "\n".join([bu.header_line(info), "", bu.table(
        title, ["layout", "TTFT ms", "TPOT ms", "e2e ms", "in collectives"], rows)])
