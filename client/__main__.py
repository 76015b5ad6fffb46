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
    cap_isa_arg(p)


def cap_isa_arg(p: argparse.ArgumentParser) -> None:
    from client.bench.isa_caps import CAPS
    p.add_argument("--cap-isa", default=None, choices=sorted(CAPS),
                   help="cap ATen, oneDNN, MKL and our kernels at this ISA (an AVX2 host's code "
                        "paths on this CPU; its memory system stays; client/bench/isa_caps.py)")


def _compare_list(value: str) -> str:
    names = [v for v in value.split(",") if v]
    bad = [v for v in names if v not in ("hf", "llamacpp")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected hf, llamacpp or both, got {value!r}")
    return ",".join(names)


def _cmd_bench_offline(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("offline", help="offline throughput/latency vs transformers and floors")
    _runtime_args(p)
    p.add_argument("--compare", type=_compare_list, default=None, metavar="hf,llamacpp",
                   help="peers to run too, comma-separated: hf (transformers), llamacpp "
                        "(llama.cpp on the same GGUF, paired rounds; `make llamacpp` first)")
    p.add_argument("--hf-dtype", default=None, choices=["float32", "bfloat16"],
                   help="transformers' dtype (default: the same as --dtype)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of workload (a) (default 3)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests of workload (b), submitted at once (default 64)")
    p.add_argument("--out", default=None, help="JSON path (default bench_results/offline-<ts>.json)")
    p.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.set_defaults(runner="client.bench.bench_offline")


def _cmd_bench_tp(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("tp", help="latency per TP degree and thread layout (seed 000)")
    _runtime_args(p)
    p.add_argument("--tp", default="1,2,4", help="TP degrees (default 1,2,4)")
    p.add_argument("--threads-per-rank", default="auto",
                   help="comma list, or 'auto': 1 per rank, plus TP1 with all cores")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="each engine's step budget, at least --input-len (default 2048, the "
                        "served default; smaller warms up faster)")
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
    p.set_defaults(runner="client.bench.bench_tp")


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
    p.set_defaults(runner="client.bench.bench_coldstart")


def _cmd_bench_clients(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("clients", help="genai-perf vs the server's llm_* histograms vs our "
                                         "client, one workload (needs make genai-perf)")
    p.add_argument("--url", default="localhost:8001", help="gRPC address of the server")
    p.add_argument("--metrics-url", default="localhost:8002")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4, help="requests sent at once (one wave)")
    p.add_argument("--backends", default="tensorrtllm,vllm", help="genai-perf payloads")
    p.add_argument("--tokenizer", default=None, help="the served model's directory "
                                                     "(default: the embedded SmolLM2)")
    p.add_argument("--out", default=None, help="JSON path (default bench_results/clients-<ts>.json)")
    p.set_defaults(runner="client.bench.bench_clients")


def _cmd_bench_prefix(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("prefix", help="prefix caching on vs off: shared system prompt, "
                                        "multi-turn chat, no shared prefix")
    _runtime_args(p)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--server", action="store_true",
                   help="through tritonserver (one server per setting) instead of offline")
    p.add_argument("--requests", type=int, default=64, help="(a) requests (default 64)")
    p.add_argument("--system-len", type=int, default=1000, help="(a) system prompt tokens")
    p.add_argument("--question-len", type=int, default=24, help="(a) question tokens")
    p.add_argument("--output-len", type=int, default=64, help="(a) output tokens")
    p.add_argument("--concurrency", type=ints, default=[1, 8], help="(a) comma list (1,8)")
    p.add_argument("--conversations", type=int, default=8, help="(b) conversations")
    p.add_argument("--turns", type=int, default=6, help="(b) turns per conversation")
    p.add_argument("--turn-len", type=int, default=40, help="(b) new tokens per turn")
    p.add_argument("--turn-output-len", type=int, default=32, help="(b) output tokens per turn")
    p.add_argument("--random-requests", type=int, default=64, help="(c) requests")
    p.add_argument("--random-rounds", type=int, default=3,
                   help="(c) paired on/off rounds, new prompts each (the median ratio counts)")
    p.add_argument("--random-in", type=int, default=256, help="(c) prompt tokens")
    p.add_argument("--random-out", type=int, default=128, help="(c) output tokens")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool per engine")
    p.add_argument("--quick", action="store_true", help="toy sizes, for smoke tests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default bench_results/prefix-<ts>.json)")
    p.set_defaults(runner="client.bench.bench_prefix")


def _cmd_bench_structured(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("structured", help="guided_json beside the same requests unconstrained")
    _runtime_args(p)
    p.add_argument("--requests", type=int, default=None, help="batch of (a) (default 64)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--out", default=None, help="JSON path (default bench_results/structured-<ts>.json)")
    p.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.set_defaults(runner="client.bench.bench_structured")


def speculation_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The options of speculative decoding's workloads: bench speculation, and bench decode's
    part 2 (there prefixed `--spec-`, stored without the prefix's dashes: spec_k, ...)."""
    a = lambda name, **kw: p.add_argument(f"--{prefix}{name}", **kw)  # noqa: E731
    a("k", type=int, default=7, help="speculative_ngram: drafts per step (default 7)")
    a("match", type=int, default=4, help="speculative_ngram_match (default 4)")
    a("prompts", type=int, default=21, help="prompts of (a) and of (b) (default 21)")
    a("max-tokens", type=int, default=192, help="output tokens at most (default 192)")
    a("concurrency", type=int, default=64, help="requests of (c) (default 64)")
    # 5: through servers a (c) round drifts up to a fifth either way (an A/A run of two
    # speculation-off servers), too much for a median of 3
    a("rounds", type=int, default=5, help="rounds of (c), on/off order alternating (default 5)")
    a("server", action="store_true", help="through tritonserver (gRPC streaming)")
    a("seed", type=int, default=0, help="seed of the generated prompts")


def _cmd_bench_speculation(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("speculation", help="n-gram speculative decoding on vs off")
    _runtime_args(p)
    speculation_args(p)
    p.add_argument("--out", default=None, help="JSON path (default bench_results/speculation-<ts>.json)")
    p.set_defaults(runner="client.bench.bench_speculation")


def _cmd_bench_spec_replay(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("spec-replay", help="speculation's draft policy replayed over recorded "
                                             "greedy outputs, steps weighed by their rows' cost")
    p.add_argument("--model", default=None, help="HF model directory (default: embedded SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--k", type=int, default=7, help="speculative_ngram (default 7)")
    p.add_argument("--match", type=int, default=4, help="speculative_ngram_match (default 4)")
    p.add_argument("--prompts", type=int, default=21, help="prompts of (a) and of (b) (default 21)")
    p.add_argument("--max-tokens", type=int, default=192, help="output tokens at most (default 192)")
    p.add_argument("--seed", type=int, default=0, help="seed of the grounded prompts")
    p.add_argument("--row-costs", default=None,
                   help="comma list: a step of 1, 2, ... rows in one-row steps "
                        "(default: the engine's, measured at its warmup)")
    p.add_argument("--out", default=None, help="JSON path: outputs and results (default: none)")
    p.set_defaults(runner="client.bench.spec_replay")


def _cmd_bench_decode(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("decode", help="batch-1 decode latency by threading mode (worker team "
                                        "vs OpenMP wait policies), quiet and with a core busy")
    # not _runtime_args: each mode sets its own wait policy, in its own process
    p.add_argument("--model", default=None, help="HF model directory (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    cap_isa_arg(p)
    from client.bench.bench_decode import DEFAULT_MODES
    p.add_argument("--modes", default=DEFAULT_MODES,
                   help="comma list: team, team-spin<us>, omp-passive, omp-active, omp-unset, "
                        f"omp-spin<count>[k] (default {DEFAULT_MODES})")
    p.add_argument("--loads", default="quiet,busy",
                   help="quiet, busy (another process spinning on a core), or both (default)")
    p.add_argument("--busy-cpu", type=int, default=(os.cpu_count() or 1) - 1,
                   help="the CPU the busy loop is pinned to (default: the last); -1: not pinned")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed requests per process (default 3)")
    p.add_argument("--rounds", type=int, default=2,
                   help="fresh processes per mode and load, interleaved (default 2)")
    p.add_argument("--give-up-ms", type=float, default=1000.0,
                   help="a mode whose probe is slower than this per token is not run further")
    p.add_argument("--cell-timeout", type=float, default=900.0, help="seconds per process")
    p.add_argument("--out", default=None, help="JSON path (default bench_results/decode-<ts>.json)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--parts", default="1,2",
                   help="1: threading modes; 2: speculative decoding on vs off (default 1,2)")
    p.add_argument("--server", action="store_true",
                   help="part 1 also through tritonserver with the default config "
                        "(perf_analyzer, concurrency 1, --rounds x --loads cells)")
    speculation_args(p, prefix="spec-")
    p.set_defaults(runner="client.bench.bench_decode")


def _cmd_bench_lora(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("lora", help="LoRA adapters vs the base model: batch-1 TPOT, "
                                      "concurrent requests over several adapters")
    _runtime_args(p)
    p.add_argument("--adapters", type=int, default=4, help="random adapters (default 4)")
    p.add_argument("--rank", type=int, default=8, help="their rank (default 8)")
    p.add_argument("--requests", type=int, default=None, help="concurrent requests (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of each kind (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")
    p.add_argument("--out", default=None, help="JSON path (default bench_results/lora-<ts>.json)")
    p.set_defaults(runner="client.bench.bench_lora")


def _cmd_bench_step_parts(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("step-parts", help="where a batch-1 decode step's time goes (GEMVs, "
                                            "attention, head, the rest)")
    _runtime_args(p)
    p.add_argument("--context", type=int, default=1056,
                   help="the sequence's tokens of context (default 1056: the mean of a "
                        "1024-in / 64-out request)")
    p.add_argument("--rounds", type=int, default=40, help="timed rounds (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    p.add_argument("--out", default=None,
                   help="JSON path (default bench_results/step-parts-<ts>.json)")
    p.set_defaults(runner="client.bench.bench_step_parts")


def _cmd_bench_parallel(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("parallel", help="n samples of a prompt vs n separate requests")
    _runtime_args(p)
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default 8)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="both sides without prefix caching (separate requests recompute the prompt)")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 5)")
    p.add_argument("--out", default=None, help="JSON path (default bench_results/parallel-<ts>.json)")
    p.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.set_defaults(runner="client.bench.bench_parallel")


def _cmd_bench_embed(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("embed", help="embeddings vs transformers' batched forward")
    _runtime_args(p)
    p.add_argument("--server", action="store_true", help="also through a tritonserver started here")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 3)")
    p.add_argument("--out", default=None, help="JSON path (default bench_results/embed-<ts>.json)")
    p.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")
    p.add_argument("--seed", type=int, default=0, help="seed of the random texts")
    p.set_defaults(runner="client.bench.bench_embed")


def _cmd_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench_cmd", required=True,
                             metavar="{offline,tp,coldstart,clients,prefix,structured,decode,"
                                     "speculation,spec-replay,lora,step-parts,parallel,embed}")
    _cmd_bench_offline(bench)
    _cmd_bench_tp(bench)
    _cmd_bench_coldstart(bench)
    _cmd_bench_clients(bench)
    _cmd_bench_prefix(bench)
    _cmd_bench_structured(bench)
    _cmd_bench_decode(bench)
    _cmd_bench_speculation(bench)
    _cmd_bench_spec_replay(bench)
    _cmd_bench_lora(bench)
    _cmd_bench_step_parts(bench)
    _cmd_bench_parallel(bench)
    _cmd_bench_embed(bench)


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


def _cmd_random_model(sub: argparse._SubParsersAction) -> None:
    from client.random_model import add_arguments
    p = sub.add_parser("random-model", help="a random checkpoint with a released model's shapes "
                                            "(a family's speed without its weights)")
    add_arguments(p)
    p.set_defaults(runner="client.random_model")


def _cmd_soak(sub: argparse._SubParsersAction) -> None:
    from client.soak import add_arguments
    p = sub.add_parser("soak", help="long mixed load (streaming or not, cancelled, invalid) "
                                    "against the server: errors, KV and memory at the end")
    add_arguments(p)
    p.set_defaults(runner="client.soak")


# NVIDIA's tools, run unchanged with the libraries they need found (client/perf_analyzer.py):
# every argument after the tool's name is the tool's own, so they bypass this parser.
TOOLS = {"perf_analyzer": "perf_analyzer (tritonclient 2.51.0's binary), arguments passed as is",
         "genai-perf": "genai-perf (`make genai-perf`), with perf_analyzer on PATH"}


def _cmd_tools(sub: argparse._SubParsersAction) -> None:
    for name, text in TOOLS.items():  # listed in --help; main() dispatches them before parsing
        sub.add_parser(name, help=text, add_help=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _cmd_bench(sub)
    _cmd_serving(sub)
    _cmd_soak(sub)
    _cmd_random_model(sub)
    _cmd_tools(sub)
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
    raw = sys.argv[1:] if argv is None else argv
    if raw and raw[0] in TOOLS:
        from client import perf_analyzer
        return perf_analyzer.main(argparse.Namespace(tool=raw[0], tool_args=raw[1:]))
    args = build_parser().parse_args(argv)
    if getattr(args, "cap_isa", None):  # before torch loads (a re-exec below inherits it)
        from client.bench import isa_caps
        isa_caps.apply(args.cap_isa)
    if argv is None and hasattr(args, "wait_policy"):  # re-exec only reproduces the real argv
        _ensure_wait_policy(args.wait_policy)
    return importlib.import_module(args.runner).main(args) or 0


if __name__ == "__main__":
    sys.exit(main())
