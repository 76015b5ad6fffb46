"""`python -m client bench coldstart`: is the first benchmark run after start as fast as the
tenth? (seed 004)

Protocol, against a freshly started server each time: warm with short prompts (N = 1, 8, 32;
input ~256, output ~128, lengths uniform in [ratio*L, L]), then run a long-prompt set three
times (64 prompts, input ~512, output ~256, fixed seed), all requests of a run submitted at once
on one gRPC stream. Each run has the same lengths and output budgets but its own tokens: with
prefix caching on (as served) a run resending the first run's prompts would skip their prefill.
Reports output tok/s per run and run1 / median(run2, run3) (target >= 0.97), once with warmup
(as served) and once with warmup disabled, to show what it buys, plus the server's cold-path
counter after each phase.
"""
from __future__ import annotations

import argparse
import queue
import random
import statistics
import tempfile
import time
from pathlib import Path

from client.bench import benchutil as bu
from client.generate import grpc_inputs
from client.server import Server, make_repo


def make_requests(tokenizer, n: int, in_len: int, out_len: int, ratio: float,
                  seed: int, variant: int = 0) -> list[tuple[str, int]]:
    """(prompt text of ~L tokens, max_tokens) pairs; lengths uniform in [ratio * L, L], drawn
    from `seed`; the tokens from (`seed`, `variant`): other variants, the same lengths."""
    rng, tokens = random.Random(seed), random.Random(f"{seed}/{variant}")
    vocab = tokenizer.vocab_size
    out = []
    for _ in range(n):
        n_in = rng.randint(max(1, int(in_len * ratio)), in_len)
        ids = [tokens.randrange(1000, vocab - 1000) for _ in range(n_in)]
        out.append((tokenizer.decode(ids), rng.randint(max(1, int(out_len * ratio)), out_len)))
    return out


def run_batch(url: str, requests: list[tuple[str, int]]) -> dict:
    """All requests at once on one stream; output tokens / wall time."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    q: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        client.async_stream_infer("llm", grpc_inputs(
            {"text_input": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": False,
             "temperature": 0.0, "exclude_input_in_output": True,
             "return_num_output_tokens": True}), request_id=str(i))
    tokens, errors = 0, 0
    for _ in requests:
        result, error = q.get(timeout=1800)
        if error is not None:
            errors += 1
            continue
        tokens += int(result.as_numpy("num_output_tokens").reshape(-1)[0])
    wall = time.perf_counter() - start
    client.stop_stream()
    client.close()
    return {"output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "errors": errors}


def cold_count(srv: Server) -> float:
    return srv.metric("llm_cold_path_events_total")


def protocol(args, warmup: bool, tokenizer, workdir: Path) -> dict:
    params = {"warmup": "true" if warmup else "false", "num_threads": str(args.threads)}
    repo = make_repo(workdir / f"repo-{warmup}", params)
    t0 = time.perf_counter()
    srv = Server(repo, workdir / f"server-{warmup}.log")
    try:
        srv.wait_ready()
        ready_s = time.perf_counter() - t0
        res = {"warmup": warmup, "start_to_ready_s": ready_s, "warm_phase": [], "runs": []}
        for n in args.warm_sizes:
            reqs = make_requests(tokenizer, n, 256, 128, args.ratio, seed=n)
            res["warm_phase"].append({"n": n, **run_batch(srv.grpc_url, reqs)})
        res["cold_after_warm_phase"] = cold_count(srv)
        for r in range(3):
            long = make_requests(tokenizer, args.prompts, args.input_len, args.output_len,
                                 args.ratio, seed=args.seed, variant=r)
            res["runs"].append(run_batch(srv.grpc_url, long))
            print(f"  warmup={warmup} run {r + 1}: {res['runs'][-1]['tok_s']:.1f} output tok/s",
                  flush=True)
        res["cold_after_runs"] = cold_count(srv)
        tok = [r["tok_s"] for r in res["runs"]]
        res["run1_over_median_rest"] = tok[0] / statistics.median(tok[1:])
        return res
    finally:
        srv.stop()


def report(info: dict, results: list[dict], args) -> str:
    rows = []
    for r in results:
        tok = [x["tok_s"] for x in r["runs"]]
        rows.append(["on" if r["warmup"] else "off", f"{r['start_to_ready_s']:.1f}",
                     *[f"{t:.1f}" for t in tok], f"{r['run1_over_median_rest']:.3f}",
                     f"{r['cold_after_warm_phase']:.0f} / {r['cold_after_runs']:.0f}"])
    title = (f"{args.prompts} prompts, input ~{args.input_len}, output ~{args.output_len}, "
             f"range ratio {args.ratio}, after warm-up batches {args.warm_sizes}")
    return "\n".join([bu.header_line(info), "", bu.table(
        title, ["warmup", "ready s", "run1 tok/s", "run2 tok/s", "run3 tok/s",
                "run1/median(2,3)", "cold path (warm phase / runs)"], rows),
        "", "  target: run1/median(run2, run3) >= 0.97 with warmup on"])


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from backend.model.gguf_import import default_model_dir
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    info = bu.run_info(args.threads, "float32", "embedded default (server)")
    results = []
    with tempfile.TemporaryDirectory(prefix="tpllm-coldstart-") as d:
        for warmup in (True, False):
            print(f"fresh server, warmup={'on' if warmup else 'off'} ...", flush=True)
            results.append(protocol(args, warmup, tokenizer, Path(d)))
    text = report(info, results, args)
    print(text)
    path = bu.write_json(args.out or bu.default_out("coldstart"),
                         {"info": info, "args": vars(args), "results": results, "report": text})
    print(f"\nwrote {path}")
    return 0
