"""Command-line entry: `python -m client bench offline ...` (more commands plug in one function each).

Each command declares its arguments here and names the module whose `main(args)` runs it, so
torch is imported only after the OpenMP wait policy has been settled (see `_ensure_wait_policy`).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys


def _runtime_args(p: argparse.ArgumentParser) -> None:
    """Options every command that loads a model shares."""
    p.add_argument("--model", default=None, help="HF model directory (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--wait-policy", default="unset", choices=["passive", "active", "unset"],
                   help="OMP_WAIT_POLICY for this run; 'unset' runs without it (default)")


def _cmd_bench_offline(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("offline", help="offline throughput/latency vs transformers and floors")
    _runtime_args(p)
    p.add_argument("--compare", choices=["hf"], default=None, help="also run HF transformers")
    p.add_argument("--hf-dtype", default=None, choices=["float32", "bfloat16"],
                   help="transformers' dtype (default: the same as --dtype)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of workload (a) (default 3)")
    p.add_argument("--out", default=None, help="JSON path (default bench_results/offline-<ts>.json)")
    p.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.set_defaults(runner="client.bench_offline")


def _cmd_bench_tp(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("tp", help="latency per TP degree and thread layout (seed 000)")
    _runtime_args(p)
    p.add_argument("--tp", default="1,2,4", help="TP degrees (default 1,2,4)")
    p.add_argument("--threads-per-rank", default="auto",
                   help="comma list, or 'auto': 1 per rank, plus TP1 with all cores")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5,
                   help="interleaved rounds: each runs every layout once (default 5)")
    p.add_argument("--pin", action="store_true", help="pin rank r to core r")
    p.add_argument("--out", default=None, help="JSON path (default bench_results/tp-<ts>.json)")
    p.add_argument("--transports", default="shm",
                   help="TP collectives: shm (one host), gloo (the between-hosts library path), "
                        "or both: shm,gloo")
    p.add_argument("--server", action="store_true",
                   help="also run every layout through a fresh tritonserver (gRPC streaming)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(runner="client.bench_tp")


def _cmd_bench_coldstart(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("coldstart", help="first run after start vs later runs (seed 004)")
    p.add_argument("--threads", type=int, default=2, help="num_threads of the served engine")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--ratio", type=float, default=0.5, help="lengths uniform in [ratio*L, L]")
    p.add_argument("--warm-sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 8, 32], help="warm-up batch sizes (default 1,8,32)")
    p.add_argument("--out", default=None, help="JSON path (default bench_results/coldstart-<ts>.json)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(runner="client.bench_coldstart")


def _cmd_bench_structured(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("structured", help="guided_json beside the same requests unconstrained")
    _runtime_args(p)
    p.add_argument("--requests", type=int, default=None, help="batch of (a) (default 64)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--out", default=None, help="JSON path (default bench_results/structured-<ts>.json)")
    p.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.set_defaults(runner="client.bench_structured")


def _cmd_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench_cmd", required=True,
                             metavar="{offline,tp,coldstart,structured}")
    _cmd_bench_offline(bench)
    _cmd_bench_tp(bench)
    _cmd_bench_coldstart(bench)
    _cmd_bench_structured(bench)


def _cmd_serving(sub: argparse._SubParsersAction) -> None:
    """generate / chat against a running server (python -m backend.serve)."""
    from client.generate import add_arguments
    p = sub.add_parser("generate", help="one request to the server, tokens printed as they arrive")
    p.add_argument("prompt")
    p.add_argument("--stream", action="store_true", help="stream the output (default: one response)")
    add_arguments(p)
    p.set_defaults(runner="client.generate")
    p = sub.add_parser("chat", help="interactive chat with the server (the model's chat template)")
    p.add_argument("--system", default=None, help="system prompt")
    add_arguments(p)
    p.set_defaults(runner="client.chat", max_tokens=256)


def _cmd_soak(sub: argparse._SubParsersAction) -> None:
    from client.soak import add_arguments
    p = sub.add_parser("soak", help="long mixed load (streaming or not, cancelled, invalid) "
                                    "against the server: errors, KV and memory at the end")
    add_arguments(p)
    p.set_defaults(runner="client.soak")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _cmd_bench(sub)
    _cmd_serving(sub)
    _cmd_soak(sub)
    return parser


def _ensure_wait_policy(policy: str) -> None:
    """libgomp reads OMP_WAIT_POLICY once, when torch loads it: if the environment differs from
    the request, re-exec this same command with the variable set (or removed)."""
    want = None if policy == "unset" else policy.upper()
    have = os.environ.get("OMP_WAIT_POLICY")
    if (have.upper() if have else None) == want:
        return
    if "torch" in sys.modules:  # called in-process after torch loaded: too late to change
        print(f"warning: OMP_WAIT_POLICY={have} already in effect; --wait-policy {policy} ignored",
              file=sys.stderr)
        return
    if want is None:
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = want
    sys.stdout.flush(), sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "client", *sys.argv[1:]])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None and hasattr(args, "wait_policy"):  # re-exec only reproduces the real argv
        _ensure_wait_policy(args.wait_policy)
    return importlib.import_module(args.runner).main(args) or 0


if __name__ == "__main__":
    sys.exit(main())
