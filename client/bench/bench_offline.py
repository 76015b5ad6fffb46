"""`python -m client bench offline`: our engine vs HF transformers vs hardware floors.

(a) concurrency 1 (TTFT, TPOT, e2e; one warm-up, then R repeats); (b) N requests submitted in one
generate call (wall, output tok/s, total tok/s). Every request produces exactly its token budget
(greedy, ignore_eos / min_new_tokens), so both systems do the same work.
"""
from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from backend import LLM, SamplingParams
from backend.engine.model_files import resolve_model_dir
from backend.model.config import ModelConfig
from client.bench import benchutil as bu
from client.bench import floors, llamacpp_peer

FULL = {"a": (1024, 64), "b": (64, 256, 128)}  # (a): in, out; (b): requests, in, out
QUICK = {"a": (128, 8), "b": (8, 32, 16)}
HF_BATCH = 16


def _stats_delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}


KEYS = ("ttft_s", "tpot_s", "e2e_s")


def _new_raw() -> dict[str, list]:
    return {k: [] for k in (*KEYS, "token_ids")}


def _record(raw: dict[str, list], ttft: float, e2e: float, tokens, out_len: int) -> None:
    """One counted request of (a): TPOT is the time after the first token over the rest."""
    raw["ttft_s"].append(ttft), raw["e2e_s"].append(e2e)
    raw["tpot_s"].append((e2e - ttft) / max(1, out_len - 1))
    raw["token_ids"].append(list(tokens))


def _summary(raw: dict[str, list]) -> dict:
    return {"raw": raw, **{k: bu.summarize(raw[k]) for k in KEYS}}


def ours_single(llm: LLM, prompts: list[list[int]], out_len: int) -> dict:
    """prompts[0] is the warm-up; each later prompt is one counted repeat."""
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    raw = _new_raw()
    before = llm.stats
    for i, p in enumerate(prompts):
        out = llm.generate([p], sp)[0]
        assert len(out.token_ids) == out_len, (len(out.token_ids), out_len)
        if i == 0:
            before = llm.stats  # engine stats of the counted repeats only
            continue
        _record(raw, out.metrics["ttft_s"], out.metrics["e2e_s"], out.token_ids, out_len)
    return {**_summary(raw), "engine_stats": _stats_delta(llm.stats, before)}


def paired_single(llm: LLM, peer, prompts: list[list[int]], out_len: int) -> tuple[dict, dict]:
    """(a) for our engine and llama.cpp in paired rounds: each prompt runs on both, back to back,
    the order alternating by round, so a shift of this shared VM's speed lands on both sides.
    prompts[0] is both systems' warm-up. Returns (ours, llama.cpp) in ours_single's form."""
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    raws = [_new_raw(), _new_raw()]
    before = llm.stats

    def run_ours(p):
        out = llm.generate([p], sp)[0]
        assert len(out.token_ids) == out_len, (len(out.token_ids), out_len)
        return out.metrics["ttft_s"], out.metrics["e2e_s"], out.token_ids

    def run_peer(p):
        got = peer.generate(p, out_len)
        assert len(got["token_ids"]) == out_len, (len(got["token_ids"]), out_len)
        return got["ttft_s"], got["e2e_s"], got["token_ids"]

    for i, p in enumerate(prompts):
        order = [(0, run_ours), (1, run_peer)][:: 1 if i % 2 == 0 else -1]
        for side, run in order:
            ttft, e2e, tokens = run(p)
            if i > 0:
                _record(raws[side], ttft, e2e, tokens, out_len)
        if i == 0:
            before = llm.stats
    ours, theirs = _summary(raws[0]), _summary(raws[1])
    ours["engine_stats"] = _stats_delta(llm.stats, before)
    # the ratio of each paired round: both sides of it saw the same machine
    theirs["ours_over_theirs"] = {k: bu.summarize([o / t for o, t in zip(raws[0][k], raws[1][k])])
                                  for k in KEYS}
    return ours, theirs


def ours_batch(llm: LLM, prompts: list[list[int]], out_len: int) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    before = llm.stats
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    assert all(len(o.token_ids) == out_len for o in outs)
    ttft, e2e = [o.metrics["ttft_s"] for o in outs], [o.metrics["e2e_s"] for o in outs]
    return {**_throughput(wall, len(prompts), len(prompts[0]), out_len),
            "ttft_s": bu.percentiles(ttft), "e2e_s": bu.percentiles(e2e),
            "engine_stats": _stats_delta(llm.stats, before)}


def _throughput(wall: float, n: int, in_len: int, out_len: int) -> dict:
    return {"wall_s": wall, "output_tok_s": n * out_len / wall,
            "total_tok_s": n * (in_len + out_len) / wall}


class HFRunner:
    def __init__(self, model_dir: str, dtype: torch.dtype, pad_id: int):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()  # generation-config chatter would drown the tables
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.pad_id = pad_id

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int) -> tuple[float, torch.Tensor]:
        """Greedy, exactly `n` new tokens per row; left padding + attention mask for batches."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=n, min_new_tokens=n, pad_token_id=self.pad_id)
        dt = time.perf_counter() - t0
        assert out.shape[1] == width + n, (out.shape, width, n)
        return dt, out[:, width:]

    def single(self, prompts: list[list[int]], out_len: int) -> dict:
        """TTFT = a max_new_tokens=1 generate; TPOT from a full generate of the same prompt."""
        raw = _new_raw()
        for i, p in enumerate(prompts):
            ttft, _ = self.generate([p], 1)
            e2e, toks = self.generate([p], out_len)
            if i > 0:  # prompt 0: warm-up
                _record(raw, ttft, e2e, toks[0].tolist(), out_len)
        return _summary(raw)

    def batch(self, prompts: list[list[int]], out_len: int) -> dict:
        walls = [self.generate(prompts[i:i + HF_BATCH], out_len)[0]
                 for i in range(0, len(prompts), HF_BATCH)]
        return {**_throughput(sum(walls), len(prompts), len(prompts[0]), out_len),
                "batch_size": HF_BATCH, "batch_wall_s": walls}


def gguf_of(model: str | None) -> Path:
    """The GGUF file llama.cpp loads: the embedded default model's own, the file our engine
    converts at start (both read the same weights)."""
    if not model:
        from backend.model.gguf_import import find_default_gguf
        return find_default_gguf()
    raise llamacpp_peer.LlamaCppUnavailable(
        f"--compare llamacpp runs the default model (a GGUF), not {model}")


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _ratios(res: dict) -> list[dict]:
    # ratios only against what ran in this invocation (a constant from another machine, e.g.
    # a published vLLM-CPU figure, is not a measurement here)
    a, b, hf, fl = res["ours"]["a"], res["ours"]["b"], res.get("hf"), res["floor"]
    lc = res.get("llamacpp")
    paired_lc = lambda k: lc["a"]["ours_over_theirs"][k]["median"] if lc else None  # noqa: E731
    paired = res["ours"].get("a_paired")
    med = lambda r, k: r[k]["median"]  # noqa: E731
    return [
        bu.ratio_row("(a) e2e ours/HF", med(a, "e2e_s") / med(hf["a"], "e2e_s") if hf else None,
                     0.7, False),
        bu.ratio_row("(a) TTFT ours/floor", med(a, "ttft_s") / fl["a"]["ttft_s"], 1.5, False),
        # the floor counts the weights as the step reads them (floors.step_weight_bytes)
        bu.ratio_row("(a) TPOT ours/floor", med(a, "tpot_s") / fl["a"]["tpot_s"], 1.6, False),
        bu.ratio_row("(a) decode step / paired read", paired["ratio"]["median"] if paired
                     else None, 1.6, False),
        bu.ratio_row("(a) TTFT ours/llama.cpp", paired_lc("ttft_s"), 0.5, False),
        bu.ratio_row("(a) TPOT ours/llama.cpp", paired_lc("tpot_s"), 0.7, False),
        bu.ratio_row("(b) output tok/s ours/HF",
                     b["output_tok_s"] / hf["b"]["output_tok_s"] if hf else None, 2.5, True),
    ]


def _paired_line(paired: dict | None) -> str:
    if not paired:
        return "paired reads: - (no C++ kernels)"
    r, g = paired["ratio"], paired["read_gbs"]
    return (f"(a)'s decode steps, each right after a read of as many bytes (this VM's bandwidth "
            f"swings between consecutive reads; best-of-5 above is the top of it): step / read "
            f"{bu.fmt_spread(r, 1, 2)} over {r['n']} steps, reads at {bu.fmt_spread(g)} GB/s")


def _llamacpp_lines(res: dict) -> list[str]:
    lc = res.get("llamacpp")
    if lc is None:
        return []
    info = res["info"]["llamacpp"]
    n = res["sizes"]["a"][1]
    fallback = [f"llama.cpp fallback: {info['fallback']}"] if info.get("fallback") else []
    return [f"llama.cpp: llama-cpp-python {info['version']} ({info['isa']}), the same GGUF, token "
            f"ids and threads, rounds paired with ours; greedy tokens equal to ours before the "
            f"first difference: {lc['greedy_agree_with_ours_a']} of {n}", *fallback,
            "ours / llama.cpp per paired round: " + ", ".join(
                f"{k.removesuffix('_s')} {bu.fmt_spread(lc['a']['ours_over_theirs'][k], 1, 2)}"
                for k in KEYS)]


def report(res: dict) -> str:
    (in_a, out_a), (n_b, in_b, out_b) = res["sizes"]["a"], res["sizes"]["b"]
    rows_a, rows_b = [], []
    hf_name = "transformers"
    if res["info"].get("hf_dtype") not in (None, res["info"]["dtype"]):
        hf_name += f" ({res['info']['hf_dtype']})"
    systems = [("ours", res["ours"]), (hf_name, res.get("hf"))]
    for name, r in systems:
        if r is not None:
            a, b = r["a"], r["b"]
            rows_a.append([name] + [bu.fmt_spread(a[k], 1e3) for k in KEYS])
            rows_b.append([name, bu.fmt_num(b["wall_s"], 2), bu.fmt_num(b["output_tok_s"]),
                           bu.fmt_num(b["total_tok_s"])])
    if (lc := res.get("llamacpp")) is not None:
        rows_a.append(["llama.cpp"] + [bu.fmt_spread(lc["a"][k], 1e3) for k in KEYS])
    fa, fb = res["floor"]["a"], res["floor"]["b"]
    rows_a.append(["floor"] + [bu.fmt_num(fa[k] * 1e3) for k in KEYS])
    rows_b.append(["floor", bu.fmt_num(fb["wall_s"], 2), bu.fmt_num(fb["output_tok_s"]),
                   bu.fmt_num(fb["total_tok_s"])])
    rates = res["floor"]["rates"]
    return "\n".join([
        bu.header_line(res["info"]),
        f"floors: GEMM {rates['matmul_shape']} {rates['matmul_gflops']:.1f} GFLOP/s, "
        f"read bandwidth {rates['read_bandwidth_gbs']:.1f} GB/s; a decode step reads "
        f"{fa['decode_bytes_per_token'] / 1e6:.0f} MB at batch 1 (weights as read "
        f"{res['ours']['step_weight_bytes']['total'] / 1e6:.0f} MB + mean context's K/V)",
        _paired_line(res["ours"].get("a_paired")),
        *_llamacpp_lines(res),
        "",
        bu.table(f"(a) concurrency 1, {in_a} in / {out_a} out, {res['repeats']} repeats "
                 "(median [min-max])", ["", "TTFT ms", "TPOT ms", "e2e ms"], rows_a),
        "",
        bu.table(f"(b) {n_b} requests x {in_b} in / {out_b} out, submitted at once",
                 ["", "wall s", "output tok/s", "total tok/s"], rows_b),
        "",
        "targets:",
        bu.ratio_lines(res["ratios"]),
    ])


def main(args: argparse.Namespace) -> int:
    sizes = dict(QUICK if args.quick else FULL)
    if getattr(args, "requests", None):  # (b)'s batch (a MoE model's batch-16 throughput)
        sizes["b"] = (args.requests, *sizes["b"][1:])
    (in_a, out_a), (n_b, in_b, out_b) = sizes["a"], sizes["b"]
    torch.set_num_threads(args.threads)  # the same threads for floors, our engine and HF
    model_dir = str(resolve_model_dir(args.model))
    cfg = ModelConfig.from_dir(model_dir)
    dtype = getattr(torch, args.dtype)
    res: dict = {"config": dict(vars(args)), "sizes": sizes, "repeats": args.repeats,
                 "info": bu.run_info(args.threads, args.dtype, model_dir)}

    # Rates measured before and after our runs (each best-of-5), keeping the best: the machine is
    # shared, and a floor is what it can do at best. The 1 GiB buffer is freed right after.
    cost = floors.ModelCost.from_config(cfg, dtype)
    rate_runs = [floors.measure(cfg, dtype, in_a)]

    prompts_a = bu.make_prompts(args.repeats + 1, in_a, cfg.vocab_size, args.seed)
    prompts_b = bu.make_prompts(n_b, in_b, cfg.vocab_size, args.seed + 1)

    compare = set(filter(None, (args.compare or "").split(",")))
    peer = None
    if "llamacpp" in compare:  # started first: a missing venv or GGUF fails before the long runs
        peer = llamacpp_peer.LlamaCppPeer(gguf_of(args.model), args.threads, in_a + out_a + 16)
        res["info"]["llamacpp"] = peer.info | {"isa": llamacpp_peer.isa_line(
            peer.info["system_info"])}

    llm = LLM(model=model_dir, dtype=args.dtype, num_threads=args.threads)
    res["info"]["model_dir"] = str(llm.engine.model_dir)
    pad_id = getattr(llm.tokenizer, "pad_token_id", None)  # random checkpoints: no tokenizer
    pad_id = pad_id if pad_id is not None else (cfg.eos_token_ids or (0,))[0]
    # the weights as a batch-1 step reads them (one rank: the bench runs TP1)
    weights_read = floors.step_weight_bytes(llm.engine.runner.model)
    if peer is not None:
        try:
            single_a, theirs = paired_single(llm, peer, prompts_a, out_a)
        finally:
            peer.close()
        res["info"]["llamacpp"]["fallback"] = peer.fallback
        res["llamacpp"] = {"a": theirs, "greedy_agree_with_ours_a": [
            _common_prefix(x, y) for x, y in zip(single_a["raw"]["token_ids"],
                                                 theirs["raw"]["token_ids"])]}
    else:
        single_a = ours_single(llm, prompts_a, out_a)
    res["ours"] = {"a": single_a, "b": ours_batch(llm, prompts_b, out_b),
                   "engine_config": vars(llm.config), "engine_stats_total": llm.stats,
                   "step_weight_bytes": weights_read}
    # (a)'s decode steps again, each beside a read of its bytes right before it (floors.py)
    step_bytes = floors.read_decode_bytes(weights_read["total"], cost, in_a + out_a / 2)
    res["ours"]["a_paired"] = floors.paired_steps(llm, prompts_a[0], out_a, step_bytes)
    del llm
    gc.collect()  # free our weights and KV pool before transformers loads its copy
    rate_runs.append(floors.measure(cfg, dtype, in_a))
    rates = {**rate_runs[0], "runs": rate_runs,
             **{k: max(r[k] for r in rate_runs) for k in ("matmul_gflops", "read_bandwidth_gbs")}}
    res["floor"] = {"rates": rates, "cost": floors.cost_dict(cost),
                    "a": floors.single_floor(cost, rates, in_a, out_a, weights_read["total"]),
                    "b": floors.batch_floor(cost, rates, n_b, in_b, out_b)}

    if "hf" in compare:
        hf_dtype = getattr(torch, getattr(args, "hf_dtype", None) or args.dtype)
        res["info"]["hf_dtype"] = str(hf_dtype).removeprefix("torch.")
        hf = HFRunner(res["info"]["model_dir"], hf_dtype, pad_id)
        res["hf"] = {"a": hf.single(prompts_a, out_a), "b": hf.batch(prompts_b, out_b)}
        del hf
        gc.collect()
        res["greedy_common_prefix_ours_hf_a"] = [
            _common_prefix(x, y) for x, y in zip(res["ours"]["a"]["raw"]["token_ids"],
                                                 res["hf"]["a"]["raw"]["token_ids"])]

    res["ratios"] = _ratios(res)
    text = report(res)
    res["report"] = text
    out = args.out or bu.default_out("offline")
    res["config"]["out"] = str(out)
    path = bu.write_json(out, res)
    print(text)
    print(f"\nwrote {path}")
    return 0
