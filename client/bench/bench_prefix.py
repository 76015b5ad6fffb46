"""`python -m client bench prefix`: automatic prefix caching on vs off, in the same run.

Workloads (text prompts; greedy with ignore_eos, so both settings do the same decode work):
 (a) shared system prompt: one ~S-token system prompt + N different ~Q-token questions, O output
     tokens each, at each concurrency (a closed loop: each client sends its next request when
     its previous one finished);
 (b) multi-turn chat: C conversations x T turns, the conversations concurrent, each turn
     resending the whole history (earlier messages and answers, as text) plus ~40 new tokens;
 (c) no shared prefix: N random prompts of I tokens, O' output tokens each, all in flight at
     once: what caching costs when nothing hits. A few percent is this VM's noise between two
     runs, so (c) runs R rounds (new prompts each), on and off paired, the order alternating;
     the ratio is the median of the rounds' ratios. Each round also records the engines' work
     (steps, tokens through the model, preemptions; through the server from its counters): the
     same work on and off means a wall-time gap is drift, not a cost of caching.
Each workload gets its own system prompt / texts, so no run finds another's prefix cached.
Offline: two engines in this process (caching on, off), each behind AsyncEngine (its own thread,
as in the server); --server: one tritonserver per setting, both started. Each workload (each
round of (c)) runs on one, then the other. TTFT is measured by the client.
"""
from __future__ import annotations

import random
import sys
import threading
import time
from dataclasses import dataclass

from client.bench import benchutil as bu
from client.server import COUNTERS_SETTLE_S

WORDS = ("river harbor lantern copper meadow signal orbit basket engine violet thunder pocket "
         "garden silver market ladder winter canyon pepper rocket marble forest window candle "
         "bridge velvet island shadow timber crystal saddle falcon pillow mirror quartz walnut "
         "anchor blossom compass desert ember glacier harvest jungle kettle lemon magnet nectar "
         "oyster paddle quiver ribbon sparrow tunnel umbrella valley whistle yonder zephyr").split()


@dataclass
class Result:
    ttft_s: float
    e2e_s: float
    output_tokens: int
    cached_tokens: int
    text: str


def make_text(tokenizer, rng: random.Random, n: int) -> str:
    """Random words cut to (about) n tokens."""
    words = " ".join(rng.choice(WORDS) for _ in range(n))
    return tokenizer.decode(tokenizer.encode(words)[:n])


class OfflineTarget:
    """An engine in this process behind AsyncEngine."""

    def __init__(self, args, caching: bool):
        from backend.engine.async_engine import AsyncEngine
        from backend.engine.config import EngineConfig
        from backend.engine.llm_engine import LLMEngine
        self.engine = LLMEngine(EngineConfig(
            model=args.model, dtype=args.dtype, num_threads=args.threads, max_num_seqs=64,
            kv_cache_memory_gb=args.kv_cache_gb, enable_prefix_caching=caching),
            defer_warmup=True)
        self.async_engine = AsyncEngine(self.engine, warm_up=True)
        self.async_engine.wait_ready()
        self.tokenizer = self.engine.tokenizer
        self._ids = iter(range(1 << 62))
        self._lock = threading.Lock()

    def submit(self, prompt: str, max_tokens: int) -> Result:
        from backend import SamplingParams
        with self._lock:
            rid = f"r{next(self._ids)}"
        t0 = time.perf_counter()
        stream = self.async_engine.add_request(rid, prompt, SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True))
        ttft, text, n, out = None, [], 0, None
        for out in stream:
            if out.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(out.text)
            n = out.num_output_tokens
        assert out.finish_reason == "length", out
        return Result(ttft, time.perf_counter() - t0, n, out.num_cached_tokens, "".join(text))

    def counters(self) -> tuple[float, float]:
        s = self.engine.stats
        return s.prefix_cache_queries, s.prefix_cache_hits

    def work(self) -> dict[str, int]:
        """The engine's work so far: a round's delta shows whether on and off did the same steps
        (a wall-time gap with the same work is this VM's drift, not caching's cost)."""
        s = self.engine.stats
        return {"steps": s.steps, "scheduled_tokens": s.scheduled_tokens,
                "preemptions": s.preemptions}

    def close(self) -> None:
        self.async_engine.shutdown()
        self.engine.close()


class ServerTarget:
    """A tritonserver on free ports with enable_prefix_caching set."""

    def __init__(self, args, caching: bool, tokenizer):
        from client.server import BenchServer
        self._bench = BenchServer({"enable_prefix_caching": str(caching).lower(),
                                   "num_threads": str(args.threads), "dtype": args.dtype,
                                   "max_num_seqs": "64", "kv_cache_memory_gb": str(args.kv_cache_gb)},
                                  args.model, "tpllm-bench-prefix-")
        self.server = self._bench.server
        self.tokenizer = tokenizer

    def submit(self, prompt: str, max_tokens: int) -> Result:
        from client.generate import generate
        first: list[float] = []
        t0 = time.perf_counter()
        out = generate({"text_input": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                        "ignore_eos": True, "stream": True, "return_num_cached_tokens": True},
                       "grpc", self.server.grpc_url,
                       on_text=lambda _: first or first.append(time.perf_counter()))
        e2e = time.perf_counter() - t0
        return Result(first[0] - t0 if first else e2e, e2e, int(out["num_output_tokens"]),
                      int(out.get("num_cached_tokens", 0)), out["text"])

    def counters(self) -> tuple[float, float]:
        time.sleep(COUNTERS_SETTLE_S)  # the last request's steps reach the counters
        return (self.server.metric("llm_prefix_cache_queries_total"),
                self.server.metric("llm_prefix_cache_hits_total"))

    def work(self) -> dict[str, int]:
        """As OfflineTarget.work, from the server's counters (read right after counters(),
        which waited for them to refresh)."""
        return {"steps": int(self.server.metric("llm_engine_steps_total")),
                "scheduled_tokens": int(self.server.metric("llm_engine_scheduled_tokens_total")),
                "preemptions": int(self.server.metric("llm_preemptions_total"))}

    def close(self) -> None:
        self._bench.stop()


def closed_loop(target, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    results: list[Result | None] = [None] * len(prompts)
    todo = iter(range(len(prompts)))
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            results[i] = target.submit(prompts[i], max_tokens)
    return _timed(target, [client] * concurrency, lambda: results)


def multi_turn(target, openings: list[str], turns: list[list[str]], max_tokens: int) -> dict:
    results: dict[tuple[int, int], Result] = {}

    def conversation(c: int):
        history = openings[c]
        for t, msg in enumerate(turns[c]):
            prompt = f"{history}\nUser: {msg}\nAssistant:"
            results[(c, t)] = r = target.submit(prompt, max_tokens)
            history = prompt + r.text
    return _timed(target, [lambda c=c: conversation(c) for c in range(len(openings))],
                  lambda: [results.get((c, t)) for c in range(len(openings))
                           for t in range(len(turns[c]))])


def _timed(target, clients, results) -> dict:
    q0, h0 = target.counters()
    w0 = target.work()
    threads = [threading.Thread(target=c) for c in clients]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    q1, h1 = target.counters()
    work = {k: v - w0[k] for k, v in target.work().items()}
    rs = results()
    assert all(r is not None for r in rs), "a request failed"
    ttft = bu.percentiles([r.ttft_s for r in rs], (50, 90))
    e2e = bu.percentiles([r.e2e_s for r in rs], (50, 90))
    out = sum(r.output_tokens for r in rs)
    return {"wall_s": wall, "ttft_p50_s": ttft["p50"], "ttft_p90_s": ttft["p90"],
            "e2e_p50_s": e2e["p50"], "e2e_p90_s": e2e["p90"], "output_tok_s": out / wall,
            "requests": len(rs), "cached_tokens": sum(r.cached_tokens for r in rs),
            "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
            "work": work, "texts": [r.text for r in rs]}


def workloads(args, tokenizer) -> list[tuple[str, list]]:
    """(name, [run(target) per round]) in order; every text is fixed by the seed. (a) and (b)
    run once; (c) runs --random-rounds times, each round on new prompts (a round's prompts
    must not find the previous round's K/V cached)."""
    rng = random.Random(args.seed)
    out = []
    for c in args.concurrency:
        system = make_text(tokenizer, rng, args.system_len)
        prompts = [f"{system}\nQuestion {i}: {make_text(tokenizer, rng, args.question_len)}"
                   for i in range(args.requests)]
        out.append((f"(a) system prompt, c={c}",
                    [lambda t, p=prompts, c=c: closed_loop(t, p, c, args.output_len)]))
    openings = [f"Conversation {c}. {make_text(tokenizer, rng, args.turn_len)}"
                for c in range(args.conversations)]
    turns = [[make_text(tokenizer, rng, args.turn_len) for _ in range(args.turns)]
             for _ in range(args.conversations)]
    out.append((f"(b) multi-turn {args.conversations}x{args.turns}",
                [lambda t: multi_turn(t, openings, turns, args.turn_output_len)]))
    rounds = []
    for r in range(args.random_rounds):
        randoms = [f"{r}.{i} {make_text(tokenizer, rng, args.random_in - 2)}"
                   for i in range(args.random_requests)]
        rounds.append(lambda t, p=randoms: closed_loop(t, p, args.random_requests,
                                                       args.random_out))
    out.append((f"(c) no shared prefix, {args.random_requests} at once", rounds))
    return out


def run(args) -> dict:
    from transformers import AutoTokenizer

    from backend.engine.model_files import resolve_model_dir
    model_dir = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    jobs = workloads(args, tokenizer)
    rounds: dict[str, list[dict]] = {name: [{} for _ in job] for name, job in jobs}
    # Both up at once (an idle server or engine sleeps), each round on one, then the other, the
    # order alternating: on and off then run minutes apart at most. (--server ran every workload
    # on one server, then all on the other: on an AMD EPYC Zen 5 (c)'s rounds drifted 28-37 s
    # on one server, so the ratio compared one stretch of the VM's drift with another.)
    targets = {}
    try:
        for key in ("on", "off"):  # the first one is closed if the second fails to start
            targets[key] = (ServerTarget(args, key == "on", tokenizer) if args.server
                            else OfflineTarget(args, key == "on"))
        for name, job in jobs:
            for r, run_round in enumerate(job):
                for key in ("on", "off") if r % 2 == 0 else ("off", "on"):
                    rounds[name][r][key] = _progress(name, key == "on", run_round, targets[key])
    finally:
        for t in targets.values():
            t.close()
    results = {name: _combine(rs) for name, rs in rounds.items()}
    return {"info": bu.run_info(args.threads, args.dtype, str(model_dir)), "results": results,
            "mode": "server" if args.server else "offline"}


def _combine(rounds: list[dict]) -> dict:
    """One workload's rounds: "on"/"off" are the round whose on/off throughput ratio is the
    median (the figures shown), "ratio" that median, "rounds" every round's figures."""
    for r in rounds:
        r["same_text"] = r["on"].pop("texts") == r["off"].pop("texts")
        r["ratio"] = r["on"]["output_tok_s"] / r["off"]["output_tok_s"]
    mid = bu.median_round(rounds)
    return {"on": mid["on"], "off": mid["off"], "ratio": mid["ratio"],
            "same_text": all(r["same_text"] for r in rounds),
            "rounds": [{"on": r["on"], "off": r["off"]} for r in rounds]}


def _progress(name: str, caching: bool, job, target) -> dict:
    r = job(target)
    print(f"{name}, caching {'on' if caching else 'off'}: {r['wall_s']:.1f}s", file=sys.stderr,
          flush=True)
    return r


def report(data: dict, args) -> str:
    rows, ratios = [], []
    for name, r in data["results"].items():
        for key in ("on", "off"):
            x = r[key]
            rows.append([f"{name} {key}", f"{x['wall_s']:.1f}", f"{1e3 * x['ttft_p50_s']:.0f}",
                         f"{1e3 * x['ttft_p90_s']:.0f}", f"{1e3 * x['e2e_p50_s']:.0f}",
                         f"{x['output_tok_s']:.1f}", f"{100 * x['hit_rate']:.0f}%",
                         "yes" if r["same_text"] else "NO"])
        on, off = r["on"], r["off"]
        if name.startswith("(a)"):
            ratios.append(bu.ratio_row(f"{name}: TTFT p50 on/off", on["ttft_p50_s"] /
                                       off["ttft_p50_s"], 0.1, False))
        elif name.startswith("(b)"):
            ratios.append(bu.ratio_row(f"{name}: total time on/off", on["wall_s"] / off["wall_s"],
                                       0.5, False))
        else:
            n = len(r["rounds"])
            ratios.append(bu.ratio_row(f"{name}: output tok/s on/off"
                                       + (f" (median of {n} paired rounds)" if n > 1 else ""),
                                       r["ratio"], 0.98, True))
    work = _work_line(data["results"])
    title = (f"prefix caching on vs off ({data['mode']}; greedy, ignore_eos; (a) {args.requests} x "
             f"(~{args.system_len} + ~{args.question_len}) in / {args.output_len} out; (b) "
             f"~{args.turn_len} new tokens a turn, {args.turn_output_len} out; (c) "
             f"{args.random_in} in / {args.random_out} out)")
    head = ["workload", "wall s", "TTFT p50 ms", "p90 ms", "e2e p50 ms", "out tok/s",
            "hit rate", "same text"]
    return "\n".join([bu.header_line(data["info"]), "", bu.table(title, head, rows), "",
                      "ratios (on / off, same run):", bu.ratio_lines(ratios)] + work)


def _work_line(results: dict) -> list[str]:
    """The no-prefix workload's engine work on / off per round."""
    name = next((n for n in results if n.startswith("(c)")), None)
    rounds = [r for r in results[name]["rounds"] if r["on"].get("work")] if name else []
    if not rounds:
        return []
    cells = [f"steps {r['on']['work']['steps']}/{r['off']['work']['steps']}, tokens "
             f"{r['on']['work']['scheduled_tokens']}/{r['off']['work']['scheduled_tokens']}, "
             f"preemptions {r['on']['work']['preemptions']}/{r['off']['work']['preemptions']}"
             for r in rounds]
    return ["", f"{name}: engine work on/off by round: " + "; ".join(cells)]


def main(args) -> int:
    if args.quick:
        args.requests, args.system_len, args.output_len = 4, 96, 4
        args.conversations, args.turns, args.turn_output_len = 2, 2, 4
        args.random_requests, args.random_in, args.random_out = 4, 32, 4
        args.random_rounds = 2
    data = run(args)
    print(report(data, args))
    path = bu.write_json(args.out or bu.default_out("prefix"), data)
    print(f"\nwrote {path}")
    return 0
