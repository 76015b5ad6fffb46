"""What serving through tritonserver costs vs the engine offline, on the same workload and threads.

    python -m client.serve_overhead [--url localhost:8001] [--requests 16] [--input-len 256]
                                    [--output-len 64] [--threads 2] [--repeats 3]
                                    [--skip-offline] [--no-stream]

Offline: LLMEngine stepped in this process (no client, no server), every token timestamped as
its step returns; "async": the same engine behind AsyncEngine (its own thread, as in the
server). Server: one gRPC stream carrying all requests at once (greedy, ignore_eos), every
response timestamped on arrival. Runs are interleaved; reported are medians of per-repeat
ratios/differences: output-token throughput ratio, mean inter-token latency per request (the
added latency per token of each stream) and wall time per generated token.
Run the server with the same engine settings (e.g. `make serve`: num_threads = torch default)
and OMP_WAIT_POLICY=PASSIVE on both sides (the launcher sets it).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def make_prompts(tokenizer, n: int, length: int) -> list[str]:
    """n distinct texts of exactly `length` tokens each."""
    base = ("The history of the city begins with a small settlement on the river, where traders "
            "and farmers met to exchange goods, stories and news from distant lands. ")
    prompts = []
    for i in range(n):
        ids = tokenizer.encode(f"Document {i}. " + base * (length // 10 + 2))[:length]
        text = tokenizer.decode(ids)
        while len(tokenizer.encode(text)) > length:
            ids = ids[:-1]
            text = tokenizer.decode(ids)
        prompts.append(text)
    return prompts


def summarize(times: dict[str, list[float]], start: float) -> dict:
    """times: request -> token arrival times (perf_counter)."""
    end = max(t[-1] for t in times.values())
    tokens = sum(len(t) for t in times.values())
    itl = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    ttft = [t[0] - start for t in times.values()]
    return {"throughput_tok_s": tokens / (end - start), "wall_s": end - start, "tokens": tokens,
            "mean_itl_ms": 1e3 * statistics.mean(itl), "mean_ttft_ms": 1e3 * statistics.mean(ttft)}


def run_offline(engine, prompts, max_tokens) -> dict:
    from backend import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"off-{i}-{start}", p, params)
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.token_ids:
                times.setdefault(o.request_id, []).extend([now] * len(o.token_ids))
    return summarize(times, start)


def run_async(engine, prompts, max_tokens) -> dict:
    """The same through AsyncEngine (the engine on its own thread, as the server runs it)."""
    from backend import AsyncEngine, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    q: queue.SimpleQueue = queue.SimpleQueue()

    class Sink:
        def put(self, out):
            q.put((time.perf_counter(), out))
    async_engine, sink, times, done = AsyncEngine(engine), Sink(), {}, 0
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        async_engine.add_request(f"async-{i}-{start}", p, params, sink=sink)
    while done < len(prompts):
        now, out = q.get()
        if out.token_ids:
            times.setdefault(out.request_id, []).extend([now] * len(out.token_ids))
        done += out.finished
    async_engine.shutdown()
    return summarize(times, start)


def run_server(url, model, prompts, max_tokens, stream: bool = True) -> dict:
    import tritonclient.grpc as grpcclient

    from client.generate import grpc_inputs
    client = grpcclient.InferenceServerClient(url)
    client.is_server_ready()  # connect before the clock starts
    q: queue.SimpleQueue = queue.SimpleQueue()

    def on_response(result, error):  # stamp on arrival, decode later
        q.put((time.perf_counter(), result, error))
    client.start_stream(callback=on_response)
    times: dict[str, list[float]] = {}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        client.async_stream_infer(model, grpc_inputs(
            {"text_input": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
             "stream": stream, "return_num_output_tokens": True}), request_id=str(i),
            enable_empty_final_response=True)
    done = 0
    while done < len(prompts):
        now, result, error = q.get(timeout=600)
        if error is not None:
            raise RuntimeError(error)
        resp = result.get_response()
        rid = resp.id
        if resp.outputs:
            # return_num_output_tokens: true = the tokens new on this response
            new = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
            times.setdefault(rid, []).extend([now] * new)
        if resp.parameters["triton_final_response"].bool_param:
            done += 1
    client.stop_stream()
    client.close()
    return summarize(times, start)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.serve_overhead", description=__doc__)
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--model", default="llm")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--no-stream", action="store_true",
                   help="also run the server non-streaming (one response per request: the cost of "
                        "per-token responses; its ITL/TTFT are not per token)")
    a = p.parse_args(argv)
    from backend import LLM
    llm = LLM(num_threads=a.threads)  # the server's defaults: kv 2 GiB, 64 seqs, 2048 tokens
    prompts = make_prompts(llm.tokenizer, a.requests, a.input_len)
    results = {"offline": [], "async": [], "server": [], "server_nostream": []}
    run_offline(llm.engine, prompts[:2], 4)  # warm up both paths once
    run_server(a.url, a.model, prompts[:2], 4)
    for r in range(a.repeats):  # interleaved, order alternating, so drift hits all alike
        runs = [("server", lambda: run_server(a.url, a.model, prompts, a.output_len))]
        if not a.skip_offline:
            runs += [("offline", lambda: run_offline(llm.engine, prompts, a.output_len)),
                     ("async", lambda: run_async(llm.engine, prompts, a.output_len))]
        if a.no_stream:
            runs.append(("server_nostream",
                         lambda: run_server(a.url, a.model, prompts, a.output_len, stream=False)))
        for name, fn in (runs if r % 2 else runs[::-1]):
            results[name].append(fn())
        print(json.dumps({k: v[-1] for k, v in results.items() if v}), "load", os.getloadavg()[0])
    srv = results["server"]
    print("server median:", json.dumps({m: statistics.median(x[m] for x in srv) for m in srv[0]}))
    if results["server_nostream"]:
        ratio = statistics.median(x["throughput_tok_s"] / y["throughput_tok_s"]
                                  for x, y in zip(srv, results["server_nostream"]))
        print(f"server streaming vs non-streaming: throughput ratio {ratio:.3f}")
    for base in ("offline", "async"):  # paired per repeat: robust to load changing between pairs
        if not results[base]:
            continue
        pairs = list(zip(srv, results[base]))
        ratio = statistics.median(s_["throughput_tok_s"] / b["throughput_tok_s"] for s_, b in pairs)
        ditl = statistics.median(s_["mean_itl_ms"] - b["mean_itl_ms"] for s_, b in pairs)
        dtok = statistics.median(1e3 / s_["throughput_tok_s"] - 1e3 / b["throughput_tok_s"]
                                 for s_, b in pairs)
        dttft = statistics.median(s_["mean_ttft_ms"] - b["mean_ttft_ms"] for s_, b in pairs)
        print(f"server vs {base} (median of {len(pairs)} paired runs): throughput ratio "
              f"{ratio:.3f}; mean ITL {ditl:+.2f} ms per request-token; wall per generated token "
              f"{dtok:+.3f} ms; TTFT {dttft:+.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
