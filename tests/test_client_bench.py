"""Smoke test of `python -m client bench offline --quick` on the default model (no HF compare)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_offline_quick(tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    # passive: the suite's setting (conftest), so the CLI need not re-exec to change it
    proc = subprocess.run(
        [sys.executable, "-m", "client", "bench", "offline", "--quick", "--repeats", "1",
         "--wait-policy", "passive", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.exists()
    data = json.loads(out.read_text())
    for key in ("config", "sizes", "info", "floor", "ours", "ratios", "report"):
        assert key in data, key
    assert "hf" not in data
    a, b = data["ours"]["a"], data["ours"]["b"]
    for k in ("ttft_s", "tpot_s", "e2e_s"):
        assert a[k]["n"] == 1 and a[k]["median"] > 0
    assert b["wall_s"] > 0 and b["output_tok_s"] > 0 and b["total_tok_s"] > b["output_tok_s"]
    assert data["floor"]["rates"]["matmul_gflops"] > 0
    assert data["floor"]["rates"]["read_bandwidth_gbs"] > 0
    assert data["floor"]["a"]["ttft_s"] > 0 and data["floor"]["a"]["tpot_s"] > 0
    assert data["info"]["omp_wait_policy"] == "PASSIVE"
    assert data["info"]["kernel_isa"] in ("avx512_bf16", "avx512", "avx2", "generic")
    assert data["info"]["gemm"] in ("mkl", "onednn")
    assert data["info"]["isa_caps"]["aten"] in ("AVX512", "AVX2", "DEFAULT")
    assert f"(ATen {data['info']['isa_caps']['aten']}" in proc.stdout
    names = [r["name"] for r in data["ratios"]]
    # no ratio against a constant measured on another machine (the old ours/vLLM-CPU line)
    assert names == ["(a) e2e ours/HF", "(a) TTFT ours/floor", "(a) TPOT ours/floor",
                     "(a) decode step / paired read", "(a) TTFT ours/llama.cpp",
                     "(a) TPOT ours/llama.cpp", "(b) output tok/s ours/HF"], names
    assert "llamacpp" not in data
    # (a)'s decode steps paired with reads of their bytes: one ratio per decode step
    paired = data["ours"]["a_paired"]
    out_a = data["sizes"]["a"][1]
    assert paired["ratio"]["n"] == out_a - 1 and paired["ratio"]["median"] > 0
    assert paired["probe_bytes"] == pytest.approx(data["floor"]["a"]["decode_bytes_per_token"],
                                                  rel=1e-3)
    assert "step / read" in proc.stdout
    assert all(r["verdict"] in ("PASS", "MISS", "n/a") for r in data["ratios"])
    assert "(a) concurrency 1" in proc.stdout and "(b) 8 requests" in proc.stdout
    # the decode floor counts the weights as the step reads them (the default model's block
    # copies and greedy head screen: well under its float32 bytes) and the mean context's K/V
    cost, fa = data["floor"]["cost"], data["floor"]["a"]
    read = data["ours"]["step_weight_bytes"]
    assert fa["weights_as_read"] and read["total"] == read["layers"] + read["lm_head"]
    assert 0.1 * cost["weight_bytes"] < read["total"] < 0.3 * cost["weight_bytes"], read
    in_a, out_a = data["sizes"]["a"]
    assert fa["decode_bytes_per_token"] == pytest.approx(
        read["total"] + cost["kv_bytes_per_token"] * (in_a + out_a / 2))
    assert "weights as read" in proc.stdout


@pytest.mark.slow
def test_bench_tp_smoke(tmp_path: Path) -> None:
    """`bench tp` end to end at toy sizes: TP1 with 1 and 2 threads, TP2 over both transports."""
    out = tmp_path / "tp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "client", "bench", "tp", "--tp", "1,2", "--input-len", "24",
         "--output-len", "3", "--repeats", "2", "--transports", "shm,gloo",
         "--max-num-batched-tokens", "64",
         "--wait-policy", "passive", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["args"]["max_num_batched_tokens"] == 64  # a small step budget: a short warmup
    layouts = [(r["tp"], r["threads_per_rank"], r["transport"]) for r in data["results"]]
    assert layouts == [(1, 1, "shm"), (1, 2, "shm"), (2, 1, "shm"), (2, 1, "gloo")]
    tp2 = [r for r in data["results"] if r["tp"] == 2]
    assert all(r["collective_s"]["median"] > 0 for r in tp2)
    for r in data["results"]:  # interleaved: every layout ran once per round
        assert sorted(run["round"] for run in r["runs"]) == [0, 1]
    assert set(data["ratios"]) == {"TP2x1/TP1x1", "TP2x1/TP1x2"}
    assert all(s["n"] == 2 and s["median"] > 0 for s in data["ratios"].values())
    assert "TP2x1/TP1x1 e2e, per round" in proc.stdout and "(gloo)" in proc.stdout


def test_bench_decode_smoke(tmp_path: Path) -> None:
    """`bench decode` end to end at toy sizes: two modes, quiet and busy, one round each (four
    processes), capped at AVX2 (--cap-isa: on an AVX-512 host the cap must reach each mode's own
    process) where the CPU runs AVX2 (every x86-64-v3 host; one without it runs uncapped)."""
    from tpllm_kernels import cpu_ext
    capped = "avx2" in cpu_ext.runnable()
    out = tmp_path / "decode.json"
    proc = subprocess.run(
        [sys.executable, "-m", "client", "bench", "decode", "--modes", "team,omp-passive",
         "--input-len", "24", "--tokens", "3", "--repeats", "1", "--rounds", "1",
         "--parts", "1", *(["--cap-isa", "avx2"] if capped else []), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    if capped:
        assert data["info"]["kernel_isa"] == "avx2" and data["info"]["isa_caps"]["aten"] == "AVX2"
        assert data["info"]["isa_caps"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
        assert all(c["kernel_isa"] == "avx2" and c["aten_isa"] == "AVX2" for c in data["cells"])
        assert "kernels avx2 (ATen AVX2, caps " in proc.stdout
    else:
        assert all(c["kernel_isa"] == data["info"]["kernel_isa"] for c in data["cells"])
    assert [(m["mode"], m["load"]) for m in data["modes"]] == [
        ("team", "quiet"), ("team", "busy"), ("omp-passive", "quiet"), ("omp-passive", "busy")]
    for m in data["modes"]:
        assert m["rounds"] == 1 and m["tpot_s"]["n"] == 1 and m["tpot_s"]["median"] > 0, m
    cells = {(c["mode"], c["load"]): c for c in data["cells"]}
    # each mode ran in its own process, in its own environment
    assert len({c["pid"] for c in cells.values()}) == 4
    assert cells["team", "quiet"]["threading"] == "team"
    assert cells["team", "quiet"]["team"]["jobs"] > 0
    omp = cells["omp-passive", "busy"]
    assert omp["threading"] == "omp" and omp["team"]["jobs"] == 0
    assert omp["environment"] == {"TPLLM_THREADING": "omp", "OMP_WAIT_POLICY": "PASSIVE"}
    # every cell has its own floor: the bandwidth right before and after it, and the bytes its
    # process's steps read (the default model's block copies and head screen: a fifth of its
    # float32 weights); issue 17's ratios count the float32 weights
    fl = data["floor"]
    assert 0 < fl["weight_bytes"] < fl["dtype_weight_bytes"] / 4
    assert fl["step_bytes"] < fl["dtype_step_bytes"] / 4
    for c in data["cells"]:
        assert len(c["bandwidth_gbs"]) == 2 and all(b > 0 for b in c["bandwidth_gbs"]), c
        assert c["step_bytes"] == fl["step_bytes"], c
        best = max(c["bandwidth_gbs"]) * 1e9
        tpot = c["runs"][0]["tpot_s"]
        assert c["floor_ratio"] == pytest.approx(tpot / (fl["step_bytes"] / best))
        assert c["dtype_floor_ratio"] == pytest.approx(tpot / (fl["dtype_step_bytes"] / best))
    for m in data["modes"]:
        assert m["floor_ratio"]["n"] == 1 and m["floor_ratio"]["median"] > 0
    # issue 53's target on the bytes as read, issue 17's on the float32 weights
    assert [r["name"] for r in data["ratios"]] == [
        "quiet TPOT team/floor", "quiet TPOT team/floor of the weights in their dtype",
        "busy TPOT team/floor of the weights in their dtype"]
    # quiet cells also pair every decode step with a read of as many bytes right before it
    for mode in ("team", "omp-passive"):
        paired = cells[mode, "quiet"]["paired"]
        assert paired["ratio"]["n"] == 2 and paired["ratio"]["median"] > 0  # 3 tokens: 2 steps
        assert paired["probe_bytes"] == pytest.approx(data["floor"]["step_bytes"], rel=1e-3)
        assert "paired" not in cells[mode, "busy"]
    assert data["part2"] is None  # --parts 1 (part 2: tests/test_speculation.py)
    assert "Part 1: batch-1 decode" in proc.stdout and "pinned to cpu" in proc.stdout


def test_cap_isa_needs_torch_unloaded(monkeypatch) -> None:
    """ATen and the GEMM libraries read their caps once, when torch loads: a cap applied after
    that would be printed in the report without being in effect, so it is refused."""
    import torch  # noqa: F401  (loaded in this process, as in any test)
    from client.bench import isa_caps
    monkeypatch.delenv("TPLLM_CPU_ISA", raising=False)
    with pytest.raises(RuntimeError, match="before torch"):
        isa_caps.apply("avx2")
    assert "TPLLM_CPU_ISA" not in os.environ
    isa_caps.apply(None)  # no cap: nothing to do, at any time


def test_paired_ratios_pair_each_round() -> None:
    """Ratios are taken round by round (each layout's median over that round's requests), over
    shared-memory layouts only, and only for pairs whose layouts both ran."""
    from client.bench.bench_layouts import Layout, paired_ratios

    def result(tp, threads, e2e_by_round, transport="shm"):
        runs = [{"round": r, "e2e_s": v} for r, vals in e2e_by_round.items() for v in vals]
        return Layout(tp, threads, transport).result(runs)

    results = [result(1, 1, {0: [10.0], 1: [20.0]}),
               result(1, 2, {0: [8.0], 1: [16.0]}),
               result(2, 1, {0: [5.0, 7.0], 1: [12.0]}),  # round 0: median of its 2 requests
               result(2, 1, {0: [100.0], 1: [100.0]}, transport="gloo")]
    ratios = paired_ratios(results, "e2e_s")
    assert set(ratios) == {"TP2x1/TP1x1", "TP2x1/TP1x2"}
    assert ratios["TP2x1/TP1x1"]["min"] == 0.6 and ratios["TP2x1/TP1x1"]["max"] == 0.6
    assert ratios["TP2x1/TP1x2"]["median"] == (6 / 8 + 12 / 16) / 2 and ratios["TP2x1/TP1x2"]["n"] == 2
    assert paired_ratios(results[:2], "e2e_s") == {}


@pytest.mark.slow
def test_bench_prefix_quick(tmp_path: Path) -> None:
    """bench prefix --quick: (c) runs paired on/off rounds on new prompts, its ratio the median."""
    out = tmp_path / "prefix.json"
    proc = subprocess.run(
        [sys.executable, "-m", "client", "bench", "prefix", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    results = data["results"]
    (c_name,) = [n for n in results if n.startswith("(c)")]
    c = results[c_name]
    assert len(c["rounds"]) == 2
    ratios = sorted(r["on"]["output_tok_s"] / r["off"]["output_tok_s"] for r in c["rounds"])
    assert c["ratio"] == pytest.approx(ratios[0])  # the lower median of two
    assert all(r["same_text"] for r in results.values())
    # a round's prompts are new: caching on finds nothing of the previous round's
    assert all(r["on"]["cached_tokens"] == 0 for r in c["rounds"])
    assert "(median of 2 paired rounds)" in proc.stdout
    # each round carries the engines' work: with nothing cached and no KV pressure, on and off
    # run the same tokens through the model
    for r in c["rounds"]:
        on, off = r["on"]["work"], r["off"]["work"]
        assert on["steps"] > 0 and on["scheduled_tokens"] == off["scheduled_tokens"] > 0
    assert "engine work on/off by round" in proc.stdout


@pytest.mark.slow
def test_bench_step_parts_smoke(tmp_path: Path) -> None:
    """`bench step-parts` at a toy context: every part timed each round, bytes counted as read."""
    out = tmp_path / "parts.json"
    proc = subprocess.run(
        [sys.executable, "-m", "client", "bench", "step-parts", "--context", "48", "--rounds", "3",
         "--wait-policy", "passive", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for part in ("step", "gemv", "attention", "head", "read"):
        assert len(data["times_s"][part]) == 3 and min(data["times_s"][part]) > 0, part
    med = data["median_s"]
    assert data["rest_s"] == pytest.approx(med["step"] - med["gemv"] - med["attention"]
                                           - med["head"])
    w = data["weight_bytes"]
    assert data["step_bytes"] == w["total"] + data["kv_bytes"]
    assert sum(data["linear_bytes"].values()) == w["layers"]  # per projection kind, summed
    assert "gemv (layers)" in proc.stdout
    # the parts timed inside the step: every part of the fused stack, each layer once a step
    in_place = data["in_place"]
    assert in_place["step"] > 0 and in_place["layers_per_step"] > 0
    assert all(in_place["parts"][p] > 0 for p in ("qkv", "attention", "gate_up", "down"))
    assert sum(in_place["parts"].values()) < in_place["step"]
    assert 0 <= in_place["team_wait"] < in_place["step"]
    assert "timed in place" in proc.stdout and "head, sampling, Python" in proc.stdout
    assert "joins' waits" in proc.stdout
    assert data["info"]["cpu"] in proc.stdout  # the report names the CPU


def test_coldstart_runs_share_lengths_not_prompts() -> None:
    """bench coldstart's three runs must do the same work without one hitting the prefix cache
    another filled (prefix caching is on as served): the same input lengths and output budgets,
    no two prompts alike."""
    from client.bench.bench_coldstart import make_requests

    class Tokenizer:  # ids as text: lengths stay countable
        vocab_size = 5000

        @staticmethod
        def decode(ids):
            return " ".join(map(str, ids))

    runs = [make_requests(Tokenizer, 16, 64, 32, 0.5, seed=7, variant=v) for v in range(3)]
    shape = [[(len(p.split()), m) for p, m in run] for run in runs]
    assert shape[0] == shape[1] == shape[2]
    assert {n for n, _ in shape[0]} != {64}  # lengths do vary within a run
    prompts = [p for run in runs for p, _ in run]
    assert len(set(prompts)) == len(prompts)
    assert make_requests(Tokenizer, 16, 64, 32, 0.5, seed=7, variant=1) == runs[1]


@pytest.mark.slow
@pytest.mark.parametrize("bench", ["parallel", "embed"])
def test_bench_parallel_and_embed_quick(tmp_path: Path, bench: str) -> None:
    """bench parallel / embed --quick: both sides do the same work (the same tokens; vectors
    within 1e-4 of transformers'), the ratio is reported."""
    out = tmp_path / f"{bench}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "client", "bench", bench, "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    if bench == "parallel":
        assert all(r["n_tokens"] == r["sep_tokens"] == 4 * 8 for r in data["rounds"])
    else:
        assert all(r["ours_max_diff"] <= 1e-4 for r in data["rounds"])
    assert "(target" in proc.stdout
