"""Helpers shared by the benchmarks: prompts, summaries, tables, run info, JSON output."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from client.bench import isa_caps


def make_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`n` prompts of exactly `length` token ids. Ids come from the middle of the vocabulary so
    that no special/control tokens (low ids) or rare merges (the tail) end up in them."""
    import torch
    lo = min(1000, vocab_size // 4)
    hi = max(lo + 1, vocab_size - lo)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (n, length), generator=g).tolist()


def summarize(xs: Sequence[float]) -> dict[str, float]:
    xs = list(xs)
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
            "mean": statistics.fmean(xs), "n": len(xs)}


def percentiles(xs: Sequence[float], ps: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    """Nearest-rank percentiles (no interpolation: every value is one that was measured)."""
    s = sorted(xs)
    return {f"p{p}": s[min(len(s) - 1, max(0, -(-p * len(s) // 100) - 1))] for p in ps}


def fmt_spread(s: dict[str, float] | None, scale: float = 1.0, digits: int = 1) -> str:
    """'median [min-max]' of a summary; a single value when min == max (one repeat)."""
    if s is None:
        return "-"
    med, lo, hi = (s[k] * scale for k in ("median", "min", "max"))
    if s.get("n", 1) <= 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def fmt_num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    cells = [list(headers)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    rule = "-" * len(line(headers))
    return "\n".join([title, line(headers), rule, *(line(r) for r in rows)])


def verdict(value: float | None, target: float, higher_is_better: bool) -> str:
    if value is None:
        return "n/a"
    ok = value >= target if higher_is_better else value <= target
    return "PASS" if ok else "MISS"


def ratio_row(name: str, value: float | None, target: float, higher_is_better: bool) -> dict:
    return {"name": name, "value": value, "target": target,
            "op": ">=" if higher_is_better else "<=",
            "verdict": verdict(value, target, higher_is_better)}


def median_round(rounds: Sequence[dict]) -> dict:
    """Of paired on/off rounds (each with its on/off "ratio"), the one whose ratio is the
    median (the lower of the middle two for an even count): a bench's robust figure on a VM
    that drifts between runs, shown with that round's own numbers."""
    return sorted(rounds, key=lambda r: r["ratio"])[(len(rounds) - 1) // 2]


def ratio_lines(ratios: Sequence[dict]) -> str:
    w = max(len(r["name"]) for r in ratios)
    return "\n".join(f"  {r['name'].ljust(w)}  {fmt_num(r['value'], 2):>7}  "
                     f"(target {r['op']} {r['target']:g})  {r['verdict']}" for r in ratios)


def cpu_model() -> str:
    """The model name, with family / model numbers: a VM may show only "AMD EPYC", and the
    numbers tell its generations apart (family 25: Zen 3 (model 1) / Zen 4 (17); 26: Zen 5)."""
    from tpllm_kernels.cpu_ext import cpuinfo_field
    name = cpuinfo_field("model name") or platform.processor() or platform.machine()
    family, model = cpuinfo_field("cpu family"), cpuinfo_field("model")
    return f"{name} (family {family} model {model})" if family and model else name


def cpu_isa_flags() -> list[str]:
    """The CPU's vector ISA flags that matter to the kernels (avx2, fma, avx512*, amx*)."""
    from tpllm_kernels import cpu_ext
    return sorted(f for f in cpu_ext.cpu_flags()
                  if f in ("avx2", "fma") or f.startswith(("avx512", "amx")))


def kernel_isa() -> str:
    """The C++ CPU kernels' variant this process dispatches to (TPLLM_CPU_ISA or the best the
    CPU runs; TP workers and a server started with the same environment pick the same)."""
    from tpllm_kernels import cpu_ext
    try:
        return cpu_ext.isa_level()
    except (RuntimeError, ValueError) as e:  # a forced level this CPU refuses
        return f"refused ({e})"


def threading_info() -> str:
    """How the C++ kernels run their parallel loops in this process: on their worker team (and
    its spin) or on torch's OpenMP (TPLLM_THREADING; a server started with the same environment
    does the same)."""
    from tpllm_kernels import cpu_threading
    if not cpu_threading.AVAILABLE:
        return "omp (no C++ kernels)"
    mode = cpu_threading.threading_mode()
    if mode != "team":
        return mode
    gemm = ", GEMM passes on OpenMP" if cpu_threading.gemm_passes_on_omp() else ""
    return f"team (spin {cpu_threading.team_spin_us()} us{gemm})"


def gemm_library() -> str:
    """The library running the float32 GEMMs beyond the C++ GEMV's rows (TPLLM_CPU_GEMM or
    by the CPU; a server started with the same environment picks the same)."""
    from tpllm_kernels import cpu_ops
    return cpu_ops.GEMM_LIBRARY if cpu_ops.AVAILABLE else "torch (no C++ kernels)"


def greedy_head_info(dtype: str) -> str:
    """How a greedy step reads the lm_head with the engine's default greedy_screening: its int8
    copy, then the few rows that can win (exact tokens; backend/model/greedy_head.py; bf16:
    steps of 1-2 rows), or the whole head. The floors count the whole head."""
    from tpllm_kernels import cpu_ops
    if dtype in ("float32", "bfloat16") and cpu_ops.GREEDY_SCREEN:
        return "screened" if dtype == "float32" else "screened (1-2 rows)"
    return "full"


def decode_weights_info(dtype: str) -> str:
    """Where a decode step reads the weights from: exact block copies where the float32 weights
    are Q4_1 / Q8_0 blocks (the default model's layers / lm_head; tpllm_kernels/cpu_blocks.py:
    the same results, 0.19x / 0.28x the bytes), or the weights as stored. The floors count the weights in
    the model's dtype, so a step may take less than its floor."""
    from tpllm_kernels import cpu_ops
    if dtype == "float32" and cpu_ops.AVAILABLE and cpu_ops.keep_block_copy is not None:
        return "exact block copies (Q4_1 layers, Q8_0 head)"
    return "as stored"


def run_info(threads: int | str, dtype: str, model_dir: str) -> dict[str, Any]:
    import torch
    return {"torch": torch.__version__, "threads": threads, "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
            "threading": threading_info(), "dtype": dtype,
            "model_dir": model_dir, "cpu": cpu_model(), "cpu_isa_flags": cpu_isa_flags(),
            "kernel_isa": kernel_isa(), "isa_caps": isa_caps.in_effect(), "gemm": gemm_library(),
            "greedy_head": greedy_head_info(dtype), "decode_weights": decode_weights_info(dtype),
            "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "loadavg_at_start": os.getloadavg()[0]}  # flags a machine busy with other work


def header_line(info: dict[str, Any]) -> str:
    return (f"torch {info['torch']} | threads {info['threads']} | OMP_WAIT_POLICY "
            f"{info['omp_wait_policy']} | kernels {info.get('kernel_isa', '?')} "
            f"({isa_caps.describe(info.get('isa_caps', {}))}), GEMM "
            f"{info.get('gemm', '?')}, threading "
            f"{info.get('threading', '?')}, greedy head {info.get('greedy_head', '?')}, decode "
            f"weights {info.get('decode_weights', '?')} | "
            f"{info['dtype']} | "
            f"{info['model_dir']} | {info['cpu']} ({info['cpu_count']} cpus; "
            f"{' '.join(info.get('cpu_isa_flags', [])) or 'no AVX2'}) | {info['date']} | "
            f"load {info['loadavg_at_start']:.2f}")


def default_out(prefix: str) -> Path:
    return Path("bench_results") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def start_busy(cpu: int | None) -> subprocess.Popen:
    """A process spinning on one core: pinned to `cpu`, or placed by the scheduler (None).
    On Linux it dies with the benchmark (PR_SET_PDEATHSIG): a benchmark killed mid-cell must
    not leave a core busy behind it."""
    code = ("import ctypes, signal, sys\n"
            "if sys.platform.startswith('linux'):\n"
            "    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG\n")
    if cpu is not None:
        code += f"import os\nos.sched_setaffinity(0, {{{cpu}}})\n"
    return subprocess.Popen([sys.executable, "-c", code + "while True:\n    pass\n"])


def stop_busy(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def cell_ratio(tpot_s: float, bandwidth_gbs: list[float], step_bytes: float) -> float:
    """TPOT over the floor at the best of the bandwidths measured around it."""
    return tpot_s / (step_bytes / (max(bandwidth_gbs) * 1e9))
