"""`python -m client bench lora`: what serving LoRA adapters costs, in one run.

Random rank-r adapters on all seven projections (q/k/v/o, gate/up/down) of the model are
written in PEFT's format to a temporary folder and loaded by one engine.
(a) one request at a time: time per output token with an adapter vs without (target <= 1.15x).
(b) N requests submitted at once, spread over the adapters, vs the same N without LoRA: output
tok/s (target >= 0.8x).
Rounds alternate the order of the two kinds. The CPU and its ISA head the report. The engine's
step budget is 256 tokens (prompts of (b) run in chunks): warmup runs every bucket twice (with
and without adapter rows), and at the default 2048 that took minutes on a 2-core host.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from backend import LLM, SamplingParams
from backend.model.config import ModelConfig
from backend.model.lora_adapter import TARGETS, module_shape
from client.bench import benchutil as bu

FULL = (16, 128, 64)  # requests of (b), prompt tokens, output tokens
QUICK = (4, 16, 8)


def write_random_adapter(out: Path, cfg: ModelConfig, rank: int, seed: int,
                         std: float = 0.02) -> Path:
    """A random PEFT adapter (B not zero: it changes the output) for every layer's projections."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, parent in TARGETS.items():
            d_in, d_out = module_shape(cfg, module)
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * std
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "use_rslora": False,
        "target_modules": list(TARGETS), "bias": "none"}))
    return out


def run_batch(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"b{time.monotonic_ns()}-{i}", p, sp)
    tokens, t0 = 0, time.perf_counter()
    while eng.has_unfinished():
        tokens += sum(len(o.token_ids) for o in eng.step())
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall}


def run_single(llm: LLM, prompt: list[int], sp: SamplingParams) -> float:
    """Time per output token after the first."""
    out = llm.generate([prompt], sp)[0]
    m, n = out.metrics, out.num_output_tokens
    return (m["e2e_s"] - m["ttft_s"]) / max(1, n - 1)


def main(args: argparse.Namespace) -> int:
    n, in_len, out_len = QUICK if args.quick else FULL
    n = args.requests or n
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        from backend.engine.model_files import resolve_model_dir
        cfg = ModelConfig.from_dir(resolve_model_dir(args.model))
        names = [f"lora{i}" for i in range(args.adapters)]
        modules = {name: str(write_random_adapter(Path(tmp) / name, cfg, args.rank, i))
                   for i, name in enumerate(names)}
        llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads,
                  max_num_seqs=max(16, n), max_num_batched_tokens=256, enable_lora=True, max_loras=args.adapters,
                  max_lora_rank=args.rank, lora_modules=modules)
        res = _measure(llm, args, names, n, in_len, out_len)
        llm.close()
    text = report(res)
    res["report"] = text
    path = bu.write_json(args.out or bu.default_out("lora"), res)
    print(text)
    print(f"\nwrote {path}")
    return 0


def _measure(llm: LLM, args, names: list[str], n: int, in_len: int, out_len: int) -> dict:
    info = bu.run_info(args.threads, args.dtype, str(llm.engine.model_dir))
    prompts = bu.make_prompts(n, in_len, llm.engine.model_config.vocab_size, args.seed)

    def sp(name: str | None) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, lora_name=name)

    res: dict = {"config": dict(vars(args)), "sizes": [n, in_len, out_len], "info": info,
                 "a": {"base": [], "lora": []}, "b": {"base": [], "lora": []}}
    for r in range(args.repeats):
        for kind in ("base", "lora") if r % 2 == 0 else ("lora", "base"):
            name = names[r % len(names)] if kind == "lora" else None
            res["a"][kind].append(run_single(llm, prompts[0], sp(name)))
            params = [sp(names[i % len(names)] if kind == "lora" else None) for i in range(n)]
            res["b"][kind].append(run_batch(llm, prompts, params))
    res["cold_path"] = llm.stats["cold_path"]
    a = {k: statistics.median(v) for k, v in res["a"].items()}
    b = {k: statistics.median(x["output_tok_s"] for x in v) for k, v in res["b"].items()}
    res["ratios"] = [
        bu.ratio_row("(a) TPOT with adapter / without, batch 1", a["lora"] / a["base"], 1.15,
                     False),
        bu.ratio_row(f"(b) output tok/s {n} requests over {len(names)} adapters / no LoRA",
                     b["lora"] / b["base"], 0.8, True),
    ]
    res["medians"] = {"a_tpot_s": a, "b_tok_s": b}
    return res


def report(res: dict) -> str:
    n, in_len, out_len = res["sizes"]
    a, b = res["medians"]["a_tpot_s"], res["medians"]["b_tok_s"]
    cfg = res["config"]
    return "\n".join([
        bu.header_line(res["info"]),
        f"adapters: {cfg['adapters']} x rank {cfg['rank']} on q/k/v/o/gate/up/down; "
        f"cold-path events after ready: {res['cold_path']}",
        "",
        bu.table(f"(a) one request, {in_len} in / {out_len} out, median of {cfg['repeats']}",
                 ["", "ms/token"], [[k, bu.fmt_num(a[k] * 1e3, 2)] for k in ("base", "lora")]),
        "",
        bu.table(f"(b) {n} requests at once, {in_len} in / {out_len} out, median of "
                 f"{cfg['repeats']}", ["", "output tok/s"],
                 [[k, bu.fmt_num(b[k])] for k in ("base", "lora")]),
        "",
        "targets:",
        bu.ratio_lines(res["ratios"]),
    ])
