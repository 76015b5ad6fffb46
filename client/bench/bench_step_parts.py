"""`python -m client bench step-parts`: where a batch-1 decode step's time goes.

One engine (the default model, --dtype, TP1), one sequence decoding at --context tokens. Each
round times, back to back and in a rotating order:
  step       a whole decode step (engine.step(): scheduling, the fused C++ layer stack, the
             greedy head, sampling, output);
  gemv       every decoder linear of the step (qkv, o, gate_up, down of every layer) in layer
             order, from the weights as the step reads them (the exact block copies);
  attention  every layer's paged decode attention over the sequence's context;
  head       the greedy lm_head (its int8 screen, then the few exact rows);
and a read of as many bytes as the step reads (the kernels' read probe). The rest of the step
(norms, rotary and KV writes, SiLU, the thread team's hand-offs, Python) is step minus the parts.
Each part runs in a loop over all layers, so like the step it streams more bytes than the caches
hold. Medians over --rounds rounds, with min-max; the CPU and its ISA head the report.

Then --rounds more steps with the fused layer stack timing its own parts in place
(decode_layer.cpp's part_timing): what each part costs inside the step, beside the others'
memory traffic, as a mean per step; the head, sampling and Python are the step's remainder. The
last row: how long the calling thread waited, at the ends of the thread team's parallel loops,
for the other thread's chunks (part of the rows above: the synchronisation's cost).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from backend import LLM, SamplingParams
from client.bench import benchutil as bu
from client.bench import floors
from tpllm_kernels.metadata import DecodeBatch

PARTS = ("step", "gemv", "attention", "head", "read")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _parts(llm: LLM, context: int):
    """The callables of each part, for a sequence at `context` tokens."""
    from tpllm_kernels import cpu_ext, cpu_ops
    ext = cpu_ext.load()
    runner = llm.engine.runner
    model = runner.model
    cfg = model.cfg
    linears = [(torch.randn(1, lin.weight.shape[1]), lin.weight,
                torch.empty(1, lin.weight.shape[0])) for lin in floors.decode_linears(model)]

    def gemv():
        for xin, w, out in linears:
            cpu_ops.linear_into(xin, w, out)

    block = llm.config.block_size
    blocks = (context + block - 1) // block
    num_blocks = runner.kv_caches[0][0].shape[0]
    # scattered blocks, as a long-running cache hands them out
    table = torch.randperm(num_blocks - 1)[:blocks].add_(1).unsqueeze(0).long()
    batch = DecodeBatch(table, torch.tensor([context], dtype=torch.long), context, block)
    q = torch.randn(1, cfg.num_heads, cfg.head_dim)
    scale = cfg.head_dim ** -0.5

    def attention():
        for k, v in runner.kv_caches:
            cpu_ops.decode_attention(q, k, v, batch, scale)

    head = model.lm_head
    xh = torch.randn(1, cfg.hidden_size)

    def head_fn():
        if head.screen is not None:
            head.screen.best(xh, head.weight)
        else:
            head(xh)

    return gemv, attention, head_fn, ext


def _in_place(engine, ext, rounds: int) -> dict | None:
    """Mean seconds per step of each part of the fused layer stack, timed inside `rounds` steps,
    and of the calling thread's waits at the ends of the team's parallel loops (inside those
    parts and the head: the other thread still on its chunks). None without the C++ kernels."""
    if ext is None or not hasattr(ext, "set_decode_part_timing"):
        return None
    waited0 = ext.team_stats()["caller_wait_ns"]
    ext.set_decode_part_timing(True)
    try:
        t0 = time.perf_counter()
        for _ in range(rounds):
            engine.step()
        step = (time.perf_counter() - t0) / rounds
        got = dict(ext.decode_part_seconds())
    finally:
        ext.set_decode_part_timing(False)
    waited = (ext.team_stats()["caller_wait_ns"] - waited0) * 1e-9
    layers = got.pop("layers")
    return {"step": step, "layers_per_step": layers / rounds,
            "parts": {k: v / rounds for k, v in got.items()}, "team_wait": waited / rounds}


def _row(name: str, ms: str, seconds: float, step: float,
         nbytes: float | None = None) -> list[str]:
    """A table row: part, its time (`ms`, as printed), share of the step, MB read and GB/s
    (blank without bytes)."""
    rate = f"{nbytes / seconds / 1e9:.1f}" if nbytes and seconds > 0 else ""
    return [name, ms, f"{seconds / step:.0%}", f"{nbytes / 1e6:.0f}" if nbytes else "", rate]


def _in_place_rows(in_place: dict, byte_of: dict[str, float]) -> list[list[str]]:
    step, parts = in_place["step"], in_place["parts"]

    def row(name: str, seconds: float, nbytes: float | None = None) -> list[str]:
        return _row(name, bu.fmt_num(seconds * 1e3, 2), seconds, step, nbytes)

    rows = [row("step", step)]
    rows += [row(name, sec, byte_of.get(name)) for name, sec in parts.items()]
    rows.append(row("head, sampling, Python (step - parts)", step - sum(parts.values())))
    rows.append(row("of all these, the joins' waits", in_place["team_wait"]))
    return rows


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    info = bu.run_info(args.threads, args.dtype, args.model or "default")
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads)
    engine = llm.engine
    cfg = engine.runner.model.cfg
    cost = floors.ModelCost.from_config(cfg, getattr(torch, args.dtype))
    weights = floors.step_weight_bytes(engine.runner.model)
    step_bytes = floors.read_decode_bytes(weights["total"], cost, args.context)
    gemv, attention, head, ext = _parts(llm, args.context)
    buf = torch.ones(int(step_bytes) // 64 * 16, dtype=torch.float32)
    read = (lambda: ext.read_probe(buf)) if ext is not None else (lambda: buf.sum())

    prompt = bu.make_prompts(1, args.context - 1, cfg.vocab_size, args.seed)[0]
    engine.add_request("parts", prompt, SamplingParams(temperature=0, max_tokens=2 * args.rounds + 8,
                                                       ignore_eos=True))
    while sum(len(o.token_ids) for o in engine.step()) == 0:  # the prompt's steps
        pass
    engine.step()  # one decode step uncounted
    fns = {"gemv": gemv, "attention": attention, "head": head, "read": read}
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {p: [] for p in PARTS}
    order = list(PARTS)
    for r in range(args.rounds):
        order = order[1:] + order[:1]
        for part in order:
            times[part].append(_timed(engine.step) if part == "step" else _timed(fns[part]))
    in_place = _in_place(engine, ext, args.rounds)
    engine.abort_request("parts")

    med = {p: statistics.median(t) for p, t in times.items()}
    rest = med["step"] - med["gemv"] - med["attention"] - med["head"]
    kv = cost.kv_bytes_per_token * args.context
    def row(name: str, part: str, nbytes: float) -> list[str]:
        return _row(name, bu.fmt_spread(bu.summarize(times[part]), 1e3, 2), med[part],
                    med["step"], nbytes)

    rows = [row("step", "step", step_bytes),
            row("gemv (layers)", "gemv", weights["layers"]),
            row("attention", "attention", kv),
            row("head (greedy)", "head", weights["lm_head"]),
            _row("rest (norms, rotary, sync, Python)", bu.fmt_num(rest * 1e3, 2), rest,
                 med["step"]),
            row("read of the step's bytes", "read", step_bytes)]
    linear_bytes = floors.layer_linear_bytes(engine.runner.model)
    byte_of = {"attention": kv, **linear_bytes}
    tables = [bu.table(f"batch-1 decode step at {args.context} tokens of context, {args.rounds} "
                       "rounds (median [min-max])", ["part", "ms", "of step", "MB read", "GB/s"],
                       rows)]
    if in_place is not None:
        tables.append(bu.table(
            f"the same step's parts timed in place, mean over {args.rounds} steps",
            ["part", "ms", "of step", "MB read", "GB/s"], _in_place_rows(in_place, byte_of)))
    text = "\n\n".join([bu.header_line(info), *tables])
    print(text)
    out = args.out or bu.default_out("step-parts")
    path = bu.write_json(out, {"info": info, "config": dict(vars(args)), "times_s": times,
                               "median_s": med, "rest_s": rest, "step_bytes": step_bytes,
                               "in_place": in_place, "linear_bytes": linear_bytes,
                               "weight_bytes": weights, "kv_bytes": kv, "report": text})
    print(f"\nwrote {path}")
    return 0
