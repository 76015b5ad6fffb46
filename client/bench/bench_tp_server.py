"""`python -m client bench tp --server`: the TP layouts through the real Triton server.

Per layout a server (python -m backend.serve on free ports, a temporary copy of
model_repository/ with tensor_parallel_size and num_threads set) serves the same kind of
requests as the offline bench: `concurrency` prompts of `input_len` tokens sent at once over one
gRPC stream, each generating exactly `output_len` tokens. All servers stay up and run in
interleaved rounds (bench_layouts). The collective share comes from each server's own metrics
(llm_collective_seconds_total / llm_model_seconds_total).
"""
from __future__ import annotations

import statistics

from client.bench import benchutil as bu
from client.bench.bench_layouts import Layout, interleave, step_budget
from client.serve_overhead import make_prompts, run_server
from client.server import BenchServer, Server


class ServerLayout:
    def __init__(self, layout: Layout, args, tokenizer):
        self.layout, self._args, self._tokenizer = layout, args, tokenizer
        self._bench: BenchServer | None = None
        self._srv: Server | None = None

    def start(self) -> None:
        a, la = self._args, self.layout
        params = {"tensor_parallel_size": str(la.tp), "num_threads": str(la.threads),
                  "dtype": a.dtype, "kv_cache_memory_gb": "1.0",
                  "max_num_batched_tokens": str(step_budget(a))}
        self._bench = BenchServer(params, a.model, "tpllm-bench-tp-")
        self._srv = self._bench.server
        warm = make_prompts(self._tokenizer, a.concurrency, a.input_len)
        run_server(self._srv.grpc_url, "llm", warm, a.output_len)  # first requests: not counted

    def run(self, r: int) -> list[dict]:
        a, srv = self._args, self._srv
        prompts = [f"{r} {p}" for p in make_prompts(self._tokenizer, a.concurrency,
                                                  a.input_len - 2)]
        model0 = srv.metric("llm_model_seconds_total")
        coll0 = srv.metric("llm_collective_seconds_total")
        res = run_server(srv.grpc_url, "llm", prompts, a.output_len)
        srv.wait_metric("llm_model_seconds_total", lambda v: v > model0, timeout=2.0)
        model = srv.metric("llm_model_seconds_total") - model0
        coll = srv.metric("llm_collective_seconds_total") - coll0
        return [{"round": r, "ttft_s": res["mean_ttft_ms"] / 1e3, "tpot_s": res["mean_itl_ms"] / 1e3,
                 "e2e_s": res["wall_s"], "collective_share": coll / model if model else 0.0}]

    def close(self) -> None:
        if self._bench is not None:
            self._bench.stop()


def run(args, layouts: list[Layout]) -> list[dict]:
    from transformers import AutoTokenizer

    from backend.engine.model_files import resolve_model_dir
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.model)))
    return interleave([ServerLayout(la, args, tokenizer) for la in layouts], args.repeats)


def report(info: dict, results: list[dict], args) -> str:
    rows = [[Layout.of(r).label, bu.fmt_spread(r["ttft_s"], 1e3),
             bu.fmt_spread(r["tpot_s"], 1e3), bu.fmt_spread(r["e2e_s"], 1e3),
             f"{100 * statistics.median(x['collective_share'] for x in r['runs']):.0f}%"]
            for r in results]
    title = (f"through tritonserver (gRPC streaming): concurrency {args.concurrency}, "
             f"{args.input_len} in / {args.output_len} out, {args.repeats} interleaved rounds "
             f"(median [min-max] over rounds)")
    return "\n".join([bu.header_line(info), "", bu.table(
        title, ["layout", "TTFT ms", "TPOT ms", "e2e ms", "in collectives"], rows)])
