"""`python -m client bench decode`: batch-1 decode latency by threading mode (issue 17).

Part 1: the time per output token (TPOT) of one sequence (default 1024 in / 64 out) for each
way the C++ kernels can run their parallel loops: the project's worker team (csrc/thread_team.h;
default spin, another spin) and torch's OpenMP under each wait policy (PASSIVE, ACTIVE, unset,
GOMP_SPINCOUNT=10000). Each mode runs in fresh processes (libgomp reads its environment once,
at load), on a quiet machine and with the other core busy (a busy-loop process, pinned to the
last CPU unless --busy-cpu -1), beside the bandwidth floor (every weight and the context's K/V
read once per token; the weights counted as the step's kernels read them: the exact block copies
and the greedy head screen, client/bench/floors.py step_weight_bytes). The floor of a cell is
taken at the read bandwidth measured right before and right after that cell (the best of both,
no busy loop running): this VM's bandwidth swings between ~30 and ~47 GB/s within minutes, so
a floor measured once at the start of a run that lasts half an hour made the same decode read as
1.2x or 1.75x of it. A mode's ratio is the median of its cells' ratios. --server adds the served default (tritonserver, the committed
model_repository config, perf_analyzer at concurrency 1): client/bench/bench_decode_server.py.
A process runs one prompt: its first request (a few tokens, uncounted) computes the prompt's
KV; the timed requests reuse it (prefix cache) and decode the same steps. --rounds processes
per mode and load, in interleaved rounds: this VM's speed differs between processes by up to
~15% (memory placement, neighbours), more than the smaller differences between modes.

Part 2 (--parts 2, with the --spec-* options): speculative decoding on vs off, batch 1 on
input-grounded and chat prompts and --spec-concurrency requests at once (client/bench/bench_speculation.py;
also `python -m client bench speculation`).

A mode whose short probe (a few tokens) is slower than --give-up-ms per token is not run
further (unbounded OpenMP spinning with the other core busy once took > 2 s per token; on this
VM, kernel 6.18, 70-130 ms).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from client.bench import bench_speculation, benchutil as bu

DEFAULT_MODES = "team,team-spin0,omp-passive,omp-active,omp-unset,omp-spin10k"
# the variables a mode sets; every other one is removed from the child's environment
_THREADING_VARS = ("TPLLM_THREADING", "TPLLM_SPIN_US", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
PROBE_TOKENS = 8
# TPOT / floor: the bytes as the step reads them (issue 53), and issue 17's targets, set when a
# step read the float32 weights, against the floor of the weights in the model's dtype
TARGETS = (("quiet", 1.6),)
DTYPE_TARGETS = (("quiet", 1.2), ("busy", 1.6))
_DTYPE_FLOOR = "floor of the weights in their dtype"


def mode_env(name: str) -> dict[str, str]:
    """The threading variables of mode `name`:
      team            the worker team, its default spin (prefill GEMMs: OpenMP, PASSIVE)
      team-spin<N>    the team, workers spin N us before sleeping
      omp-passive | omp-active | omp-unset   at::parallel_for under that OMP_WAIT_POLICY
      omp-spin<N>[k]  at::parallel_for, GOMP_SPINCOUNT=N (x1000 with k), policy unset"""
    if name == "team":
        return {"TPLLM_THREADING": "team", "OMP_WAIT_POLICY": "PASSIVE"}
    if m := re.fullmatch(r"team-spin(\d+)", name):
        return {"TPLLM_THREADING": "team", "TPLLM_SPIN_US": m.group(1),
                "OMP_WAIT_POLICY": "PASSIVE"}
    if m := re.fullmatch(r"omp-(passive|active)", name):
        return {"TPLLM_THREADING": "omp", "OMP_WAIT_POLICY": m.group(1).upper()}
    if name == "omp-unset":
        return {"TPLLM_THREADING": "omp"}
    if m := re.fullmatch(r"omp-spin(\d+)(k?)", name):
        count = int(m.group(1)) * (1000 if m.group(2) else 1)
        return {"TPLLM_THREADING": "omp", "GOMP_SPINCOUNT": str(count)}
    raise ValueError(f"unknown mode {name!r} (team, team-spin<us>, omp-passive, omp-active, "
                     "omp-unset, omp-spin<count>[k])")


def _env_label(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items() if k != "TPLLM_THREADING")


def child_env(mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _THREADING_VARS}
    return env | mode_env(mode)


def run_cell(args, mode: str, load: str, round_: int) -> dict:
    """One mode under one load, in a fresh process; its measurements (or why there are none),
    with the bytes its decode steps read (step_bytes: the size of a quiet cell's paired reads)."""
    spec = {"model": args.model, "dtype": args.dtype, "threads": args.threads,
            "input_len": args.input_len, "tokens": args.tokens, "repeats": args.repeats,
            "seed": args.seed, "give_up_ms": args.give_up_ms, "paired": load == "quiet"}
    busy_cpu = None if args.busy_cpu < 0 else args.busy_cpu
    cell = {"mode": mode, "load": load, "round": round_, "env": mode_env(mode)}
    with tempfile.TemporaryDirectory() as d:
        spec_path, out_path = Path(d) / "spec.json", Path(d) / "out.json"
        spec_path.write_text(json.dumps(spec))
        busy = bu.start_busy(busy_cpu) if load == "busy" else None
        cell["loadavg_at_start"] = os.getloadavg()[0]
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "client.bench.bench_decode", "--child", str(spec_path),
                 str(out_path)], env=child_env(mode), capture_output=True, text=True,
                timeout=args.cell_timeout)
            rc, tail = proc.returncode, proc.stderr[-2000:]
        except subprocess.TimeoutExpired:
            rc, tail = None, f"timed out after {args.cell_timeout} s"
        finally:
            if busy is not None:
                bu.stop_busy(busy)
        cell["loadavg_at_end"] = os.getloadavg()[0]
        if rc == 0 and out_path.exists():
            return cell | json.loads(out_path.read_text())
        return cell | {"error": f"exit {rc}: {tail}"}


def summarize_cells(cells: list[dict]) -> dict:
    """A mode under a load over its rounds: TPOT median [min-max] over every timed request,
    or why there is none (any round that gave up or failed says so)."""
    out: dict = {"rounds": len(cells)}
    if errors := [c["error"] for c in cells if "error" in c]:
        out["error"] = errors[0]
    if gave_up := [c["probe_tpot_s"] for c in cells if c.get("gave_up")]:
        out["gave_up"], out["probe_tpot_s"] = True, min(gave_up)
    runs = [r for c in cells for r in c.get("runs", [])]
    if runs:
        out["tpot_s"] = bu.summarize([r["tpot_s"] for r in runs])
    for key in ("floor_ratio", "dtype_floor_ratio"):
        if ratios := [c[key] for c in cells if key in c]:
            out[key] = bu.summarize(ratios)
    if paired := [c["paired"]["ratio"]["median"] for c in cells if c.get("paired")]:
        out["paired_ratio"] = bu.summarize(paired)
    team = [c["team"] for c in cells if c.get("team")]
    if team:
        out["team"] = {k: sum(t[k] for t in team) for k in team[0]}
    return out


def child_main(spec_path: str, out_path: str) -> int:
    """Runs in the mode's environment: loads the engine, probes, then times `repeats` requests."""
    import torch
    from backend import LLM, SamplingParams
    from backend.engine.model_files import resolve_model_dir
    from client.bench import floors
    from tpllm_kernels import cpu_ext, cpu_threading

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    model_dir = str(resolve_model_dir(spec["model"]))
    llm = LLM(model=model_dir, dtype=spec["dtype"], num_threads=spec["threads"], max_num_seqs=4,
              kv_cache_memory_gb=0.25, cpu_packed_gemm=False, warmup=False)
    ext = cpu_ext.load()
    vocab = llm.engine.model_config.vocab_size
    # what this process's decode steps read: the weights as its kernels read them (block copies
    # where it keeps them, the greedy head screen) and the K/V at the request's mean context
    cost = floors.ModelCost.from_config(llm.engine.model_config, getattr(torch, spec["dtype"]))
    weights_read = floors.step_weight_bytes(llm.engine.runner.model)["total"]
    step_bytes = floors.read_decode_bytes(weights_read, cost,
                                          spec["input_len"] + spec["tokens"] / 2)
    # one prompt: its first request (the probe) computes its KV, the timed ones reuse it (prefix
    # cache), so a cell costs one prefill; the decode steps are the same either way
    prompt = bu.make_prompts(1, spec["input_len"], vocab, spec["seed"])[0]
    out = {"kernel_isa": cpu_ext.isa_level(), "aten_isa": torch.backends.cpu.get_cpu_capability(),
           "threading": cpu_threading.threading_mode() if ext is not None else "none",
           "spin_us": ext.team_spin_us() if ext is not None else None,
           "torch_threads": torch.get_num_threads(), "pid": os.getpid(),
           "weight_bytes": weights_read, "step_bytes": step_bytes,
           "environment": {k: os.environ[k] for k in _THREADING_VARS if k in os.environ}}

    def tpot(tokens: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        m = llm.generate([prompt], sp)[0].metrics
        return (m["e2e_s"] - m["ttft_s"]) / max(1, tokens - 1)

    out["probe_tpot_s"] = tpot(min(PROBE_TOKENS, spec["tokens"]))  # also the warm-up
    if out["probe_tpot_s"] * 1e3 > spec["give_up_ms"]:
        out["gave_up"] = True
    else:
        before = cpu_threading.team_stats()
        out["runs"] = [{"tpot_s": tpot(spec["tokens"])} for _ in range(spec["repeats"])]
        after = cpu_threading.team_stats()
        out["team"] = {k: after[k] - before.get(k, 0) for k in after if k != "workers"}
        if spec["paired"]:  # None without the kernels (no probe)
            out["paired"] = floors.paired_steps(llm, prompt, spec["tokens"], step_bytes)
    Path(out_path).write_text(json.dumps(out))
    return 0


def _tpot(cell: dict | None) -> str:
    if cell is None:
        return "-"
    if "tpot_s" in cell:
        return bu.fmt_spread(cell["tpot_s"], 1e3)
    if cell.get("gave_up"):
        return f"> {cell['probe_tpot_s'] * 1e3:.0f} (gave up)"
    return "failed" if "error" in cell else "-"


def _ratio(cell: dict | None, key: str = "floor_ratio") -> float | None:
    if cell is None or key not in cell:
        return None
    return cell[key]["median"]


def _ratio_text(cell: dict | None) -> str:
    return "-" if _ratio(cell) is None else bu.fmt_spread(cell["floor_ratio"], 1, 2)


def _worker_share(cell: dict | None) -> str:
    team = (cell or {}).get("team") or {}
    return f"{100 * team['worker_chunks'] / team['chunks']:.0f}%" if team.get("chunks") else "-"


def report(res: dict) -> str:
    info, loads = res["info"], res["config"]["loads"]
    by = {(m["mode"], m["load"]): m for m in res["modes"]}
    headers, rows = ["mode", "environment"], []
    for load in loads:
        headers += [f"{load} TPOT ms", "/floor"]
    if "quiet" in loads:
        headers.append("step/paired read")
    headers.append(f"chunks on workers ({'/'.join(loads)})")
    for mode in res["config"]["modes"]:
        row = [mode, _env_label(mode_env(mode)) or "-"]
        for load in loads:
            m = by.get((mode, load))
            row += [_tpot(m), _ratio_text(m)]
        if "quiet" in loads:
            q = by.get((mode, "quiet")) or {}
            row.append(bu.fmt_spread(q["paired_ratio"], 1, 2) if "paired_ratio" in q else "-")
        row.append(" / ".join(_worker_share(by.get((mode, load))) for load in loads))
        rows.append(row)
    loadavg = bu.summarize([c["loadavg_at_start"] for c in res["cells"]])
    errors = [f"  {c['mode']}/{c['load']} round {c['round']}: {c['error'][-300:]}"
              for c in res["cells"] if "error" in c]
    rates = bu.summarize([b for c in res["cells"] for b in c.get("bandwidth_gbs", [])])
    fl = res["floor"]
    cfg = res["config"]
    text = [bu.header_line(info)]
    if fl["step_bytes"] and rates:
        text.append(
            f"floor: {fl['weight_bytes'] / 1e6:.0f} MB of weights as the step's kernels read "
            f"them (header: decode weights; {fl['dtype_weight_bytes'] / 1e6:.0f} MB in "
            f"{cfg['dtype']}) + {(fl['step_bytes'] - fl['weight_bytes']) / 1e6:.0f} MB of K/V "
            f"(mean context) per token at the read bandwidth measured right before and after "
            f"each cell (best of the two; over the run {bu.fmt_spread(rates)} GB/s: "
            f"{fl['step_bytes'] / (rates['max'] * 1e6):.1f}-"
            f"{fl['step_bytes'] / (rates['min'] * 1e6):.1f} ms per token); /floor: median "
            f"[min-max] of the cells' ratios; the {_DTYPE_FLOOR} (issue 17's targets) counts "
            f"{fl['dtype_step_bytes'] / 1e6:.0f} MB")
    text += [
        "step/paired read (quiet cells): each decode step's time over the time of a read of "
        "as many bytes right before it (median of a cell's steps; median [min-max] of cells)",
        f"busy: {cfg['busy']}",
        f"1-minute load average at the start of a cell: median {loadavg['median']:.2f} "
        f"[{loadavg['min']:.2f}-{loadavg['max']:.2f}] (this run's own processes included)",
        "",
        bu.table(f"Part 1: batch-1 decode, {cfg['input_len']} in / {cfg['tokens']} out; per "
                 f"mode and load {cfg['rounds']} fresh processes (interleaved rounds) x "
                 f"{cfg['repeats']} requests: median [min-max]", headers, rows),
    ]
    if errors:
        text += ["", "failed cells:", *errors]
    if res.get("served"):
        from client.bench import bench_decode_server
        text += ["", bench_decode_server.report(res["served"], cfg["repeats"])]
    text += ["", "targets (offline: mode team; served: the default config):",
             bu.ratio_lines(res["ratios"])]
    return "\n".join(text)


def run_part1(args, modes: list[str], loads: list[str], cost, res: dict) -> None:
    """The threading modes (fresh processes each) beside the bandwidth floor, into res."""
    from client.bench import floors
    # every weight in the model's dtype and the context's K/V once (the request's mean context):
    # issue 17's floor; each cell's own is what its steps read (its process counts them)
    dtype_step_bytes = cost.mean_decode_bytes(args.input_len, args.tokens)
    # Round r runs the modes from the r-th on: this VM's speed drifts over minutes and differs
    # between processes. Each cell's floor: the read bandwidth (best of 5 reads of 1 GiB, this
    # process, nothing else running) right before and after it.
    cells = []
    for r in range(args.rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            for load in loads:
                before = floors.read_bandwidth_gbs()
                c = run_cell(args, mode, load, r)
                c["bandwidth_gbs"] = [before, floors.read_bandwidth_gbs()]
                if c.get("runs"):
                    tpot = statistics.median(x["tpot_s"] for x in c["runs"])
                    c["floor_ratio"] = bu.cell_ratio(tpot, c["bandwidth_gbs"], c["step_bytes"])
                    c["dtype_floor_ratio"] = bu.cell_ratio(tpot, c["bandwidth_gbs"],
                                                           dtype_step_bytes)
                cells.append(c)
                print(f"round {r} {mode:>14} {load:>5}: {_tpot(summarize_cells([c]))} ms/token "
                      f"(load {c['loadavg_at_start']:.2f}, read "
                      f"{'/'.join(f'{b:.1f}' for b in c['bandwidth_gbs'])} GB/s)",
                      file=sys.stderr, flush=True)
    res["cells"] = cells
    res["modes"] = [{"mode": m, "load": load, "env": mode_env(m),
                     **summarize_cells([c for c in cells if (c["mode"], c["load"]) == (m, load)])}
                    for m in modes for load in loads]
    # the floor the report names: the team cells' bytes (a mode without the C++ kernels reads
    # the float32 weights: its cells' ratios use their own)
    read = next((c for c in cells if c["mode"] == "team" and "step_bytes" in c),
                next((c for c in cells if "step_bytes" in c), None))
    res["floor"] = {"weight_bytes": read["weight_bytes"] if read else None,
                    "step_bytes": read["step_bytes"] if read else None,
                    "dtype_weight_bytes": cost.weight_bytes, "dtype_step_bytes": dtype_step_bytes,
                    "cost": floors.cost_dict(cost)}
    by = {(m["mode"], m["load"]): m for m in res["modes"]}
    res["ratios"] = [
        *(bu.ratio_row(f"{load} TPOT team/floor", _ratio(by.get(("team", load))), target, False)
          for load, target in TARGETS if load in loads),
        *(bu.ratio_row(f"{load} TPOT team/{_DTYPE_FLOOR}",
                       _ratio(by.get(("team", load)), "dtype_floor_ratio"), target, False)
          for load, target in DTYPE_TARGETS if load in loads)]


def run_part2(args) -> dict:
    """Speculative decoding on vs off (client/bench/bench_speculation.py) with the --spec-* options,
    in this process (two engines, the kernels' default threading: the worker team)."""
    spec = argparse.Namespace(**{k.removeprefix("spec_"): v for k, v in vars(args).items()
                                 if k.startswith("spec_")},
                              model=args.model, dtype=args.dtype, threads=args.threads)
    print("part 2: speculative decoding on vs off ...", file=sys.stderr, flush=True)
    return bench_speculation.run(spec)


def main(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        mode_env(m)  # unknown names fail before anything runs
    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    if not loads or set(loads) - {"quiet", "busy"}:
        raise SystemExit(f"--loads: quiet and/or busy, not {args.loads!r}")
    # this process only measures the floor: its OpenMP threads must not spin into a mode's run
    if "torch" not in sys.modules:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    import torch

    from backend.engine.model_files import resolve_model_dir
    from backend.model.config import ModelConfig
    from client.bench import floors

    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model_dir(args.model))
    cfg = ModelConfig.from_dir(model_dir)
    cost = floors.ModelCost.from_config(cfg, getattr(torch, args.dtype))
    info = bu.run_info(args.threads, args.dtype, model_dir)
    info["omp_wait_policy"] = info["threading"] = "per mode"
    busy = ("none" if "busy" not in loads else
            "one busy-loop process (python `while True: pass`) "
            + (f"pinned to cpu {args.busy_cpu}" if args.busy_cpu >= 0 else "not pinned")
            + "; the benchmark's own threads are not pinned")
    config = dict(vars(args)) | {"modes": modes, "loads": loads, "busy": busy}
    config.pop("runner", None)
    res: dict = {"config": config, "info": info}

    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if not parts or parts - {"1", "2"}:
        raise SystemExit(f"--parts: 1 and/or 2, not {args.parts!r}")
    if "1" in parts:
        run_part1(args, modes, loads, cost, res)
        if args.server:
            from client.bench import bench_decode_server
            fl = res["floor"]
            # the server reads what the offline team cells read (the same default engine)
            step_bytes = fl["step_bytes"] or fl["dtype_step_bytes"]
            res["served"] = bench_decode_server.run(args, loads, step_bytes, model_dir)
            served = res["served"]["loads"]
            # a ratio to the dtype floor is the same TPOT over a floor that many times longer
            to_dtype = step_bytes / fl["dtype_step_bytes"]
            for targets, floor, scale in ((TARGETS, "floor", 1.0),
                                          (DTYPE_TARGETS, _DTYPE_FLOOR, to_dtype)):
                res["ratios"] += [row for load, target in targets if load in loads for row in (
                    bu.ratio_row(f"{load} TPOT served default/{floor} (perf_analyzer, logprobs)",
                                 served[load]["floor_ratio"]["median"] * scale, target, False),
                    bu.ratio_row(f"{load} TPOT served default/{floor} (greedy, gRPC)",
                                 served[load]["grpc_floor_ratio"]["median"] * scale, target,
                                 False))]
    res["part2"] = run_part2(args) if "2" in parts else None

    text = "\n\n".join(
        ([report(res)] if "1" in parts else [bu.header_line(info)])
        + ([bench_speculation.report(res["part2"])] if res["part2"] else []))
    res["report"] = text
    out = args.out or bu.default_out("decode")
    res["config"]["out"] = str(out)
    path = bu.write_json(out, res)
    print(text)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], sys.argv[3]))
    sys.exit("run it as: python -m client bench decode [options]")
