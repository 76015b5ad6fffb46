"""genai-perf vs the server's own llm_* histograms vs this project's client, one workload.

    python -m client bench clients --url localhost:8001 --metrics-url localhost:8002
        [--input-len 512] [--output-len 64] [--concurrency 4] [--backends tensorrtllm,vllm]

Every run is one wave of `--concurrency` streaming requests sent at once (greedy, ignore_eos,
exactly `--output-len` tokens): genai-perf with `--concurrency N --request-count N` (its own
synthetic prompts of the same token length, each `--backends` payload), and our client
(client/serve_overhead.run_server: N prompts on one gRPC stream, every response stamped on
arrival). Around each run the server's histograms are read: their sum/count deltas are the
server-side means of exactly that run's requests (TTFT: request arrival in the model -> first
token; ITL: a request's mean time between tokens; e2e). Needs `make genai-perf`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from client.bench.benchutil import cpu_model, default_out, fmt_num, table, write_json
from client.server import ROOT

HISTOGRAMS = {"ttft": "llm_time_to_first_token_seconds", "itl": "llm_inter_token_latency_seconds",
              "e2e": "llm_e2e_request_latency_seconds"}


def server_sums(metrics_url: str) -> dict[str, float]:
    """{'<histogram>_sum' / '_count': value} summed over instances."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if any(name in (h + "_sum", h + "_count") for h in HISTOGRAMS.values()):
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def server_means(before: dict, after: dict) -> dict[str, float | None]:
    """Mean of each histogram over the requests observed between the two reads (ms)."""
    res = {}
    for key, h in HISTOGRAMS.items():
        n = after.get(h + "_count", 0) - before.get(h + "_count", 0)
        s = after.get(h + "_sum", 0) - before.get(h + "_sum", 0)
        res[key] = 1e3 * s / n if n else None
    return res


def run_genai_perf(a, backend: str, tokenizer_dir: str, artifacts: Path) -> dict:
    cmd = [sys.executable, "-m", "client", "genai-perf", "profile", "-m", "llm",
           "--endpoint-type", "kserve", "--backend", backend, "--streaming", "-u", a.url,
           "--tokenizer", tokenizer_dir, "--synthetic-input-tokens-mean", str(a.input_len),
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(a.output_len),
           "--output-tokens-mean-deterministic", "--extra-inputs", "ignore_eos:true",
           "--extra-inputs", "temperature:0.0",
           # perf_analyzer 2.51 and an output a response lacks: model_repository/README.md
           "--extra-inputs", "return_cumulative_logprob:true", "--concurrency", str(a.concurrency),
           "--request-count", str(a.concurrency), "--warmup-request-count", "0",
           "--artifact-dir", str(artifacts)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    [export] = list(artifacts.rglob("*_genai_perf.json"))
    s = json.loads(export.read_text())
    return {"ttft": s["time_to_first_token"]["avg"], "itl": s["inter_token_latency"]["avg"],
            "e2e": s["request_latency"]["avg"], "tok_s": s["output_token_throughput"]["avg"],
            "out_len": s["output_sequence_length"]["avg"]}


def run_ours(a, prompts: list[str]) -> dict:
    from client.serve_overhead import run_server
    r = run_server(a.url, "llm", prompts, a.output_len)
    return {"ttft": r["mean_ttft_ms"], "itl": r["mean_itl_ms"], "e2e": None,
            "tok_s": r["throughput_tok_s"], "out_len": r["tokens"] / len(prompts)}


def main(a) -> int:
    from transformers import AutoTokenizer

    from backend.model.gguf_import import default_model_dir
    from client.serve_overhead import make_prompts
    tok_dir = str(a.tokenizer or default_model_dir())
    prompts = make_prompts(AutoTokenizer.from_pretrained(tok_dir), a.concurrency, a.input_len)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["ours", *(f"genai-perf {b}" for b in a.backends.split(","))]:
            before = server_sums(a.metrics_url)
            if name == "ours":
                client = run_ours(a, prompts)
            else:
                client = run_genai_perf(a, name.split()[1], tok_dir, Path(tmp) / name.split()[1])
            runs[name] = {"client": client,
                          "server": server_means(before, server_sums(a.metrics_url))}
    rows = [[name, fmt_num(r["client"]["ttft"]), fmt_num(r["server"]["ttft"]), fmt_num(r["client"]["itl"]),
             fmt_num(r["server"]["itl"]), fmt_num(r["client"]["e2e"]), fmt_num(r["server"]["e2e"]),
             fmt_num(r["client"]["tok_s"]), fmt_num(r["client"]["out_len"])] for name, r in runs.items()]
    print(f"{cpu_model()} ({os.cpu_count()} cpus), load {os.getloadavg()[0]:.1f} | "
          f"{a.concurrency} requests at once, {a.input_len} in / {a.output_len} out, greedy")
    print(table("client vs server (ms; tok/s = output tokens per second seen by the client)",
                ["run", "TTFT client", "TTFT server", "ITL client", "ITL server", "e2e client",
                 "e2e server", "tok/s", "out len"], rows))
    path = write_json(a.out or default_out("clients"), {"args": vars(a), "runs": runs})
    print(f"results: {path}")
    return 0
