"""`python -m client bench decode --server`: part 1's batch-1 decode through tritonserver with
the default config (issue 17's target is the served default, not only the offline engine).

One server over a copy of model_repository/ with nothing overridden (its threading, wait policy
and spin are the committed ones). Per round and load: the read bandwidth (client/bench/floors.py, this
process, server idle, no busy loop), then perf_analyzer at concurrency 1 (`--streaming`, the
`--input-data` of client/perf_data.py: one prompt of --input-len tokens, --tokens out, greedy,
ignore_eos) with the busy loop running for a busy cell, then the same prompt as plain greedy
requests from tritonclient's gRPC stream, then the bandwidth again. TPOT is the mean
inter-token latency of perf_analyzer's profile export (what its users read as ITL) and of the
gRPC requests' token arrivals; the floor is the step's bytes at the better of the two
bandwidths around the cell. Why both clients: perf_analyzer's inputs ask for
`return_cumulative_logprob` (client/perf_data.py says why), so its rows read the whole float32
lm_head; a plain greedy request takes the screened head (docs/architecture.md, Greedy
lm_head). The server's prefix cache serves the repeated prompt after the first request: the
decode steps, which are what is timed, are the same.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from client.bench import benchutil as bu


def _input_data(args, model_dir: str, dest: Path) -> Path:
    """The committed 1024/64 file, or one written for other lengths."""
    from client.perf_analyzer import INPUT_DATA
    from client.perf_data import input_data
    if (args.input_len, args.tokens) == (1024, 64) and args.model is None:
        return INPUT_DATA
    from transformers import AutoTokenizer

    from client.serve_overhead import make_prompts
    prompt = make_prompts(AutoTokenizer.from_pretrained(model_dir), 1, args.input_len)[0]
    dest.write_text(json.dumps(input_data(prompt, args.tokens)))
    return dest


def _perf_analyzer(grpc_url: str, data: Path, requests: int, export: Path) -> dict:
    from client.perf_analyzer import ROOT
    from client.perf_data import summarize_export
    cmd = [sys.executable, "-m", "client", "perf_analyzer", "-m", "llm", "-u", grpc_url,
           "-i", "grpc", "--streaming", "--input-data", str(data), "--concurrency-range", "1",
           "--request-count", str(requests), "--profile-export-file", str(export)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0 or not export.exists() or export.stat().st_size == 0:
        raise RuntimeError(f"perf_analyzer exit {p.returncode}: {(p.stdout + p.stderr)[-1500:]}")
    return summarize_export(export)


def _grpc_greedy(grpc_url: str, prompt: str, tokens: int, requests: int) -> float:
    """Median over `requests` sequential greedy requests (no logprobs) of their mean
    inter-token latency, seconds, from tritonclient's gRPC stream (client/serve_overhead.py)."""
    from client.serve_overhead import run_server
    return statistics.median(run_server(grpc_url, "llm", [prompt], tokens)["mean_itl_ms"]
                             for _ in range(requests)) / 1e3


def run(args, loads: list[str], step_bytes: float, model_dir: str) -> dict:
    """Rounds x loads of the served default beside their floors; cells and per-load summaries."""
    from client.bench import floors
    from client.server import BenchServer

    busy_cpu = None if args.busy_cpu < 0 else args.busy_cpu
    cells: list[dict] = []
    print("served default: starting tritonserver ...", file=sys.stderr, flush=True)
    srv = BenchServer({}, model=args.model)
    try:
        with tempfile.TemporaryDirectory(prefix="tpllm-decode-") as d:
            data = _input_data(args, model_dir, Path(d) / "data.json")
            # the first request computes the prompt's KV (and any first-request cost): uncounted
            _perf_analyzer(srv.server.grpc_url, data, 1, Path(d) / "warm.json")
            prompt = json.loads(data.read_text())["data"][0]["text_input"][0]
            for r in range(args.rounds):
                for load in loads:
                    before = floors.read_bandwidth_gbs()
                    busy = bu.start_busy(busy_cpu) if load == "busy" else None
                    try:
                        s = _perf_analyzer(srv.server.grpc_url, data, args.repeats,
                                           Path(d) / f"export-{r}-{load}.json")
                        greedy = _grpc_greedy(srv.server.grpc_url, prompt, args.tokens,
                                              args.repeats)
                    finally:
                        if busy is not None:
                            bu.stop_busy(busy)
                    bw = [before, floors.read_bandwidth_gbs()]
                    tpot = s["itl_ms"] / 1e3
                    cells.append({"round": r, "load": load, "tpot_s": tpot, "ttft_s": s["ttft_s"],
                                  "requests": s["requests"], "bandwidth_gbs": bw,
                                  "floor_ratio": bu.cell_ratio(tpot, bw, step_bytes),
                                  "grpc_tpot_s": greedy,
                                  "grpc_floor_ratio": bu.cell_ratio(greedy, bw, step_bytes)})
                    print(f"served round {r} {load:>5}: ITL {tpot * 1e3:.1f} ms "
                          f"(greedy gRPC {greedy * 1e3:.1f}; read {bw[0]:.1f}/{bw[1]:.1f} GB/s, "
                          f"/floor {cells[-1]['floor_ratio']:.2f}, "
                          f"{cells[-1]['grpc_floor_ratio']:.2f})", file=sys.stderr, flush=True)
    finally:
        srv.stop()
    by_load = {load: {key: bu.summarize([c[key] for c in cells if c["load"] == load])
                      for key in ("tpot_s", "floor_ratio", "grpc_tpot_s", "grpc_floor_ratio")}
               for load in loads}
    return {"cells": cells, "loads": by_load}


def report(served: dict, requests: int) -> str:
    rows = [[load, bu.fmt_spread(s["tpot_s"], 1e3), bu.fmt_spread(s["floor_ratio"], 1, 2),
             bu.fmt_spread(s["grpc_tpot_s"], 1e3), bu.fmt_spread(s["grpc_floor_ratio"], 1, 2)]
            for load, s in served["loads"].items()]
    return bu.table(f"Served default (tritonserver, committed config, conc 1, {requests} requests "
                    f"per cell and client): ITL median [min-max] over cells; perf_analyzer "
                    f"(its inputs ask for logprobs: whole head), then plain greedy requests "
                    f"from tritonclient's gRPC stream (screened head)",
                    ["load", "perf_analyzer TPOT ms", "/floor", "greedy gRPC TPOT ms", "/floor"],
                    rows)
