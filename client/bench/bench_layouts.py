"""Benchmark layouts that stay loaded side by side and run in interleaved rounds.

Each layout (an offline engine in its own process, or a tritonserver) is started once; then
round r runs every layout once, starting from layout r % n, so that each layout in turn goes
first and a machine whose speed drifts moves all layouts together. Ratios between layouts are
taken per round (paired), not between medians gathered minutes apart.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import traceback
from dataclasses import dataclass
from typing import Callable, Protocol

from client.bench import benchutil as bu


@dataclass(frozen=True)
class Layout:
    tp: int
    threads: int
    transport: str = "shm"

    @property
    def label(self) -> str:
        text = f"TP{self.tp} x {self.threads} thr"
        return text + (f" ({self.transport})" if self.tp > 1 and self.transport != "shm" else "")

    @property
    def key(self) -> str:
        return f"TP{self.tp}x{self.threads}"

    @classmethod
    def of(cls, result: dict) -> "Layout":
        return cls(result["tp"], result["threads_per_rank"], result.get("transport", "shm"))

    def result(self, runs: list[dict]) -> dict:
        """This layout's runs with a median [min-max] summary of each measured field."""
        fields = [k for k in runs[0] if k != "round"]
        return {"tp": self.tp, "threads_per_rank": self.threads, "transport": self.transport,
                "runs": runs, **{k: bu.summarize([r[k] for r in runs]) for k in fields}}


class LayoutRunner(Protocol):
    layout: Layout

    def start(self) -> None: ...
    def run(self, r: int) -> list[dict]: ...  # round r: one dict per request, "round": r
    def close(self) -> None: ...


RunFn = Callable[[object, Layout, int, object], list]  # (args, layout, round, llm) -> runs


class OfflineLayout:
    """An offline engine (backend.LLM) for one layout, in its own process: the layouts set
    different torch thread counts, which are per process, and TP workers belong to it."""

    def __init__(self, layout: Layout, args, run_fn: RunFn):
        self.layout = layout
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_offline_main, args=(args, layout, run_fn, child),
                                 name=f"bench-{layout.key}-{layout.transport}")

    def start(self) -> None:
        self._proc.start()
        self._reply()  # loaded, and its first (uncounted) request done

    def run(self, r: int) -> list[dict]:
        self._conn.send(r)
        return self._reply()

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._proc.join(60)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(10)

    def _reply(self):
        if not self._conn.poll(900):
            raise TimeoutError(f"{self.layout.label}: no answer in 900 s")
        kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"{self.layout.label} failed:\n{value}")
        return value


def step_budget(args) -> int:
    """Each layout's max_num_batched_tokens (offline and served): --max-num-batched-tokens, at
    least one whole prompt."""
    return max(args.max_num_batched_tokens, args.input_len)


def _offline_main(args, layout: Layout, run_fn: RunFn, conn) -> None:
    os.environ["TPLLM_TP_TRANSPORT"] = layout.transport  # read by the group (workers inherit it)
    llm = None
    try:
        from backend import LLM
        llm = LLM(model=args.model, dtype=args.dtype, tensor_parallel_size=layout.tp,
                  num_threads=layout.threads, pin_cpus=args.pin, kv_cache_memory_gb=1.0,
                  max_num_batched_tokens=step_budget(args))
        run_fn(args, layout, -1, llm)  # the first request: not counted
        conn.send(("ok", None))
        while (r := conn.recv()) is not None:
            conn.send(("ok", run_fn(args, layout, r, llm)))
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if llm is not None:
            llm.close()


def interleave(runners: list[LayoutRunner], rounds: int) -> list[dict]:
    """Starts every runner (one at a time), runs `rounds` rotating rounds, closes them all;
    returns each layout's result (Layout.result), in the runners' order."""
    started: list[LayoutRunner] = []
    runs: dict[int, list[dict]] = {i: [] for i in range(len(runners))}
    try:
        for rn in runners:
            print(f"loading {rn.layout.label} ...", flush=True)
            rn.start()
            started.append(rn)
        order = list(range(len(runners)))
        for r in range(rounds):
            k = r % len(order)
            for i in order[k:] + order[:k]:
                runs[i].extend(runners[i].run(r))
            print(f"round {r + 1}/{rounds} done", flush=True)
    finally:
        for rn in started:
            rn.close()
    return [rn.layout.result(runs[i]) for i, rn in enumerate(runners)]


PAIRS = {"TP2x1/TP1x1": ((2, 1), (1, 1)), "TP2x1/TP1x2": ((2, 1), (1, 2))}


def paired_ratios(results: list[dict], field: str) -> dict[str, dict]:
    """Per round, the seed's layout pairs' ratio of `field` (each layout's median over that
    round's requests), summarized over rounds; shared-memory layouts only."""
    per_round: dict[tuple[int, int], dict[int, float]] = {}
    for res in results:
        if res.get("transport", "shm") != "shm":
            continue
        by_round: dict[int, list[float]] = {}
        for run in res["runs"]:
            by_round.setdefault(run["round"], []).append(run[field])
        per_round[(res["tp"], res["threads_per_rank"])] = {
            r: statistics.median(v) for r, v in by_round.items()}
    out = {}
    for name, (num, den) in PAIRS.items():
        if num in per_round and den in per_round:
            rounds = sorted(per_round[num].keys() & per_round[den].keys())
            if rounds:
                out[name] = bu.summarize([per_round[num][r] / per_round[den][r] for r in rounds])
    return out
