"""Speculative decoding (n-gram prompt lookup) on vs off, in the same run: part 2 of
`python -m client bench decode` (also `python -m client bench speculation` alone).

Workloads (chat-formatted text prompts, greedy, natural stops, at most --max-tokens):
 (a) input-grounded: rewrite a code snippet with one change, copy a list with numbering, pull
     the sentences about one subject out of a passage (--prompts of them, three kinds in turn);
 (b) free-form chat: open questions and writing tasks with nothing to copy;
 (c) --concurrency requests of (a) in flight at once, --rounds times (new prompts each, the on/off
     order alternating; the ratio is the median of the rounds').
(a) and (b) run one request at a time (batch 1), speculation off and on alternating per prompt;
the greedy tokens of the two are compared (they must be identical). Offline: two engines in this
process. --server: one tritonserver per setting, both started (the idle one sleeps), gRPC
streaming, the client measuring.
"""
from __future__ import annotations

import random
import threading
import time

from client.bench import benchutil as bu
from client.server import COUNTERS_SETTLE_S

WORDS = ("river harbor lantern copper meadow signal orbit basket engine violet thunder pocket "
         "garden silver market ladder winter canyon pepper rocket marble forest window candle "
         "bridge velvet island shadow timber crystal saddle falcon pillow mirror quartz walnut").split()
SUBJECTS = ("the harbor", "the lighthouse", "the market", "the bridge")
CHAT = ["Write a short story about a robot who learns to paint.",
        "Explain why the sky is blue to a ten-year-old.",
        "What are three good habits for staying healthy? Explain each.",
        "Describe a day in the life of a medieval blacksmith.",
        "Give me advice on preparing for a job interview.",
        "Write a poem about the ocean at night.",
        "What is the difference between weather and climate?",
        "Tell me about the history of bread.",
        "How do bees make honey?",
        "Write a letter inviting a friend to a picnic.",
        "Why do we have seasons on Earth?",
        "Describe your ideal city of the future.",
        "What makes a good teacher?",
        "Explain how a bicycle works.",
        "Write a short dialogue between a cat and a dog.",
        "What should I pack for a week-long hiking trip?",
        "Explain what photosynthesis is.",
        "Invent a new holiday and describe how people celebrate it.",
        "What are the benefits of learning a second language?",
        "Describe the taste of a lemon to someone who never had one."]


def _code(rng: random.Random) -> tuple[str, str]:
    names = rng.sample(["total", "count", "items", "value", "result", "index", "price", "score"], 4)
    a, b, c, d = names
    fn = rng.choice(["compute_report", "update_prices", "collect_scores", "merge_records"])
    code = (f"def {fn}({a}, {b}):\n    {c} = 0\n    for {d} in {a}:\n        if {d} > {b}:\n"
            f"            {c} += {d}\n        else:\n            {c} -= 1\n"
            f"    print(\"{fn} done\", {c})\n    return {c}\n\n\n"
            f"def check_{fn}():\n    {a} = [1, 5, 9, 12, 3]\n    {b} = 4\n"
            f"    assert {fn}({a}, {b}) >= 0\n    return True\n")
    new = rng.choice([x for x in ["amount", "tally", "accum", "sum_so_far"] if x not in names])
    return (f"Rewrite this Python code, renaming the variable `{c}` to `{new}`. Change nothing "
            f"else and output the whole code.\n\n```python\n{code}```"), "code"


def _listing(rng: random.Random) -> tuple[str, str]:
    items = [f"{rng.choice(WORDS)} {rng.choice(WORDS)}" for _ in range(16)]
    return ("Copy the list below, numbering each line (1., 2., ...). Output only the list.\n\n"
            + "\n".join(items)), "list"


def _extraction(rng: random.Random) -> tuple[str, str]:
    subject = rng.choice(SUBJECTS)
    sentences = []
    for _ in range(12):
        s = rng.choice(SUBJECTS)
        sentences.append(f"In the {rng.choice(WORDS)} season {s} was full of {rng.choice(WORDS)} "
                         f"and {rng.choice(WORDS)} traders.")
    return (f"Passage:\n{' '.join(sentences)}\n\nQuote, word for word, every sentence of the "
            f"passage that mentions {subject}, one per line."), "extract"


def grounded_prompts(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    makers = (_code, _listing, _extraction)
    return [makers[i % 3](rng) for i in range(n)]


def chat_prompts(n: int) -> list[tuple[str, str]]:
    return [(CHAT[i % len(CHAT)], "chat") for i in range(n)]


class OfflineTarget:
    def __init__(self, args, k: int):
        from backend import LLM
        self.llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads,
                       max_num_seqs=max(64, args.concurrency), speculative_ngram=k,
                       speculative_ngram_match=args.match)
        self.tokenizer = self.llm.tokenizer

    def batch(self, prompts: list[str], max_tokens: int) -> list[list[int]]:
        from backend import SamplingParams
        outs = self.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
        self.last_ttft = [o.metrics.get("ttft_s") for o in outs]
        return [o.token_ids for o in outs]

    def spec_counts(self) -> tuple[float, float]:
        s = self.llm.stats
        return s["spec_draft_tokens"], s["spec_accepted_tokens"]

    def work(self) -> dict[str, float]:
        """Engine steps, drafts and seconds in steps so far: (c)'s rounds show how much of a gap
        between on and off is work, how much the steps' speed (this VM's drift) and how much
        time outside the steps."""
        s = self.llm.stats
        return {"steps": s["steps"], "drafts": s["spec_draft_tokens"],
                "model_s": s["model_seconds"]}

    def close(self) -> None:
        self.llm.close()


class ServerTarget:
    def __init__(self, args, k: int):
        from client.server import BenchServer
        self._bench = BenchServer({"speculative_ngram": str(k),
                                   "speculative_ngram_match": str(args.match),
                                   "num_threads": str(args.threads), "dtype": args.dtype,
                                   "max_num_seqs": str(max(64, args.concurrency))},
                                  args.model, "tpllm-bench-spec-")
        self.server = self._bench.server

    def batch(self, prompts: list[str], max_tokens: int) -> list[str]:
        from client.generate import generate
        out: list = [None] * len(prompts)
        first: list = [None] * len(prompts)  # when each request's first text arrived

        def one(i):
            t0 = time.perf_counter()

            def on_text(_text):
                if first[i] is None:
                    first[i] = time.perf_counter() - t0
            out[i] = generate({"text_input": prompts[i], "max_tokens": max_tokens,
                               "temperature": 0.0, "stream": True,
                               "exclude_input_in_output": True}, "grpc", self.server.grpc_url,
                              on_text=on_text)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.last_tokens = sum(int(o["num_output_tokens"]) for o in out)
        self.last_ttft = first
        return [o["text"] for o in out]

    def spec_counts(self) -> tuple[float, float]:
        time.sleep(COUNTERS_SETTLE_S)  # the last request's steps reach the counters
        return (self.server.metric("llm_spec_draft_tokens_total"),
                self.server.metric("llm_spec_accepted_tokens_total"))

    def work(self) -> dict[str, float]:
        """As OfflineTarget.work, from the server's counters."""
        time.sleep(COUNTERS_SETTLE_S)  # the last request's steps reach the counters
        return {"steps": int(self.server.metric("llm_engine_steps_total")),
                "drafts": int(self.server.metric("llm_spec_draft_tokens_total")),
                "model_s": self.server.metric("llm_model_seconds_total")}

    def close(self) -> None:
        self._bench.stop()


def _count(target, results) -> int:
    if isinstance(results[0], str):  # server: texts; the server counted the tokens
        return target.last_tokens
    return sum(len(r) for r in results)


def batch1(targets: dict, prompts: list[str], max_tokens: int) -> dict:
    """Each prompt alone, the two settings alternating (off first on even prompts). Besides
    tok/s over whole requests (the target's), tok/s after each request's first token: the part
    speculation changes (the prompt's prefill is the same work on and off, and dilutes the
    whole-request ratio by its share)."""
    secs = {k: 0.0 for k in targets}
    toks = {k: 0 for k in targets}
    firsts = {k: 0.0 for k in targets}  # seconds to each request's first token, summed
    same = 0
    for i, p in enumerate(prompts):
        order = list(targets) if i % 2 == 0 else list(targets)[::-1]
        got = {}
        for name in order:
            t0 = time.perf_counter()
            got[name] = targets[name].batch([p], max_tokens)
            secs[name] += time.perf_counter() - t0
            toks[name] += _count(targets[name], got[name])
            firsts[name] += sum(t or 0.0 for t in targets[name].last_ttft)
        same += got["off"] == got["on"]
    out = {name: {"output_tokens": toks[name], "seconds": secs[name],
                  "tok_s": toks[name] / secs[name], "first_token_s": firsts[name],
                  # the tokens after each request's first, over the time after it
                  "after_first_tok_s": (toks[name] - len(prompts))
                  / max(1e-9, secs[name] - firsts[name])} for name in targets}
    out["identical"] = f"{same}/{len(prompts)}"
    out["ratio"] = out["on"]["tok_s"] / out["off"]["tok_s"]
    out["after_first_ratio"] = out["on"]["after_first_tok_s"] / out["off"]["after_first_tok_s"]
    return out


def concurrent(targets: dict, rounds: list[list[str]], max_tokens: int) -> dict:
    """All of a round's prompts at once on each setting, the order alternating per round (each
    round its own prompts). With 64 in flight a step has no room for drafts (the CPU verify
    cap), so on and off do nearly the same work and one pair of runs mostly measures this VM's
    drift between them: the ratio is the median of the rounds' ratios, the figures shown are
    that round's."""
    runs = []
    for r, prompts in enumerate(rounds):
        out = {}
        for name in list(targets) if r % 2 == 0 else list(targets)[::-1]:
            work = getattr(targets[name], "work", dict)
            w0, t0 = work(), time.perf_counter()
            res = targets[name].batch(prompts, max_tokens)
            dt = time.perf_counter() - t0
            n = _count(targets[name], res)
            out[name] = {"output_tokens": n, "seconds": dt, "tok_s": n / dt,
                         **{k: v - w0[k] for k, v in work().items()}}
        out["ratio"] = out["on"]["tok_s"] / out["off"]["tok_s"]
        runs.append(out)
    mid = dict(bu.median_round(runs))
    mid["rounds"] = [round(o["ratio"], 3) for o in runs]
    mid["work"] = [{name: {k: o[name][k] for k in ("steps", "drafts", "model_s") if k in o[name]}
                    for name in ("on", "off")} for o in runs]
    return mid


def _chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def run(args) -> dict:
    """The three workloads, offline or through servers; returns the report's data."""
    from backend.engine.model_files import load_tokenizer, resolve_model_dir
    tokenizer = load_tokenizer(resolve_model_dir(args.model))
    grounded = [_chat(tokenizer, p) for p, _ in grounded_prompts(args.prompts, args.seed)]
    chat = [_chat(tokenizer, p) for p, _ in chat_prompts(args.prompts)]
    many = [[_chat(tokenizer, p) for p, _ in grounded_prompts(args.concurrency, args.seed + 1 + r)]
            for r in range(args.rounds)]
    make = ServerTarget if args.server else OfflineTarget
    data = {"k": args.k, "match": args.match, "max_tokens": args.max_tokens,
            "prompts": args.prompts, "concurrency": args.concurrency, "rounds": args.rounds,
            "mode": "server" if args.server else "offline"}
    # both up at once (an idle one sleeps), so each prompt runs off and on back to back
    targets = {"off": make(args, 0), "on": make(args, args.k)}
    try:
        data["grounded_batch1"] = batch1(targets, grounded, args.max_tokens)
        data["chat_batch1"] = batch1(targets, chat, args.max_tokens)
        data["grounded_concurrent"] = concurrent(targets, many, args.max_tokens)
        drafted, accepted = targets["on"].spec_counts()
        data["acceptance"] = {"draft_tokens": drafted, "accepted_tokens": accepted,
                              "rate": accepted / drafted if drafted else None}
    finally:
        for t in targets.values():
            t.close()
    return data


def report(data: dict) -> str:
    rows = []
    for key, title in (("grounded_batch1", "(a) input-grounded, batch 1"),
                       ("chat_batch1", "(b) free-form chat, batch 1"),
                       ("grounded_concurrent", f"(c) (a) x {data['concurrency']} concurrent, "
                                               f"median of {data['rounds']} rounds")):
        r = data[key]
        rows.append([title, bu.fmt_num(r["off"]["tok_s"]), bu.fmt_num(r["on"]["tok_s"]),
                     f"{r['ratio']:.2f}x", r.get("identical", "-")])
    acc = data["acceptance"]
    rate = "-" if acc["rate"] is None else f"{acc['rate']:.0%}"
    ratios = [bu.ratio_row("(a) batch-1 tok/s on/off", data["grounded_batch1"]["ratio"], 1.6, True),
              bu.ratio_row("(b) batch-1 tok/s on/off", data["chat_batch1"]["ratio"], 0.97, True),
              bu.ratio_row("(c) concurrent tok/s on/off", data["grounded_concurrent"]["ratio"],
                           1.0, True)]
    return (bu.table(f"speculative decoding ({data['mode']}): speculative_ngram {data['k']}, "
                     f"match {data['match']}, max_tokens {data['max_tokens']}",
                     ["workload", "off tok/s", "on tok/s", "on/off", "identical greedy"], rows)
            + f"\ndrafts accepted: {acc['accepted_tokens']:.0f} of {acc['draft_tokens']:.0f} ({rate})\n"
            + _after_first_line(data) + _work_line(data["grounded_concurrent"])
            + bu.ratio_lines(ratios))


def _after_first_line(data: dict) -> str:
    """(a) and (b) after each request's first token (no target: where the whole-request ratio
    would be if the prompts' prefill took no time)."""
    cells = []
    for key, name in (("grounded_batch1", "(a)"), ("chat_batch1", "(b)")):
        r = data[key]
        cells.append(f"{name} {bu.fmt_num(r['off']['after_first_tok_s'])} -> "
                     f"{bu.fmt_num(r['on']['after_first_tok_s'])} tok/s "
                     f"{r['after_first_ratio']:.2f}x (first tokens {r['off']['first_token_s']:.1f}"
                     f"/{r['on']['first_token_s']:.1f} s of {r['off']['seconds']:.1f}"
                     f"/{r['on']['seconds']:.1f})")
    return "after each request's first token (off -> on): " + "; ".join(cells) + "\n"


def _work_line(c: dict) -> str:
    """(c)'s rounds: on/off ratio, engine steps on/off, drafts verified, seconds in steps."""
    works = c.get("work") or []
    if not works or not all(w["on"] for w in works):
        return ""
    cells = [f"{ratio:.3f} (steps {w['on']['steps']}/{w['off']['steps']}, "
             f"{w['on']['drafts']} drafts, in steps {w['on']['model_s']:.1f}/"
             f"{w['off']['model_s']:.1f} s)" for ratio, w in zip(c["rounds"], c["work"])]
    return "(c) rounds on/off: " + "; ".join(cells) + "\n"


def main(args) -> int:
    info = bu.run_info(args.threads, args.dtype, args.model or "SmolLM2-135M-Instruct (embedded)")
    print(bu.header_line(info), flush=True)
    data = run(args)
    data["info"] = info
    print(report(data))
    path = bu.write_json(args.out or bu.default_out("speculation"), data)
    print(f"wrote {path}")
    return 0
