"""llama.cpp as a benchmark peer (client/bench/llamacpp_peer.py, llamacpp_worker.py): the
worker's protocol, the paired rounds, and the errors a user meets without `make llamacpp`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from client.bench import bench_offline, llamacpp_peer

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for llama-cpp-python with its API's shape (Llama(...).reset / .generate yielding
# token ids forever, llama_print_system_info; Llama reading its model parameters from
# llama_cpp.llama's llama_cpp.llama_model_default_params): lets the worker's own code run here,
# where the real build (minutes of compiling) is not installed. With FAKE_LLAMA_SEGV set, a
# generate with the extra buffer types on dies of SIGSEGV, as the real AMX path does on an AMX
# host.
FAKE_LLAMA_CPP = textwrap.dedent('''
    import os, signal, sys
    __version__ = "0.0-test"
    def llama_print_system_info():
        return b"CPU : AVX2 = 1 | AVX512 = 0 | FMA = 1 | "
    class Llama:
        def __init__(self, model_path, n_threads, n_threads_batch, n_ctx, n_batch, verbose):
            from llama_cpp import llama
            self.extra_bufts = llama.llama_cpp.llama_model_default_params().use_extra_bufts
            self.cache = []
            print("LOAD", model_path, n_threads, n_ctx, self.extra_bufts, file=sys.stderr)
        def reset(self):
            self.cache = []
        def generate(self, tokens, temp, top_k, top_p, min_p, repeat_penalty, reset):
            if self.extra_bufts and os.environ.get("FAKE_LLAMA_SEGV"):
                os.kill(os.getpid(), signal.SIGSEGV)
            assert temp == 0.0 and top_k == 1 and self.cache == []
            self.cache = list(tokens)
            while True:  # as the real one: never stops by itself
                nxt = (sum(self.cache) * 31 + len(self.cache)) % 1000
                self.cache.append(nxt)
                yield nxt
''')


@pytest.fixture
def fake_venv(tmp_path: Path) -> Path:
    """A 'venv' whose python is this interpreter with the stand-in on its path."""
    site = tmp_path / "site"
    (site / "llama_cpp").mkdir(parents=True)
    (site / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    (site / "llama_cpp" / "llama_cpp.py").write_text(textwrap.dedent('''
        class Params:
            use_extra_bufts = True
        def llama_model_default_params():
            return Params()
    '''))
    (site / "llama_cpp" / "llama.py").write_text("import llama_cpp.llama_cpp as llama_cpp\n")
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    return tmp_path / "venv"


def test_worker_protocol(fake_venv: Path, tmp_path: Path) -> None:
    with llamacpp_peer.LlamaCppPeer(tmp_path / "m.gguf", 2, 64, venv=fake_venv) as peer:
        assert peer.info["version"] == "0.0-test"
        assert llamacpp_peer.isa_line(peer.info["system_info"]) == "AVX2, FMA"
        first = peer.generate([1, 2, 3], 5)
        again = peer.generate([1, 2, 3], 5)  # an empty cache each time: the same tokens
        other = peer.generate([4, 5], 3)
    assert len(first["token_ids"]) == 5 and first["token_ids"] == again["token_ids"]
    assert len(other["token_ids"]) == 3
    assert 0 < first["ttft_s"] <= first["e2e_s"]
    assert peer.proc.returncode == 0  # "quit" ends it
    assert peer.fallback is None


def test_worker_crash_on_first_request_retries_without_extra_buffers(
        fake_venv: Path, tmp_path: Path, monkeypatch) -> None:
    """llama.cpp's AMX matmul segfaulting in the first request (an AMX host): the peer loads the
    model again with use_extra_bufts off, answers that request and says so."""
    monkeypatch.setenv("FAKE_LLAMA_SEGV", "1")
    with llamacpp_peer.LlamaCppPeer(tmp_path / "m.gguf", 2, 64, venv=fake_venv) as peer:
        assert peer.fallback is None
        first = peer.generate([1, 2, 3], 5)
        again = peer.generate([1, 2, 3], 5)
        assert "signal 11" in peer.fallback and "use_extra_bufts off" in peer.fallback
    assert len(first["token_ids"]) == 5 and first["token_ids"] == again["token_ids"]
    res = {"llamacpp": {"greedy_agree_with_ours_a": [5], "a": {"ours_over_theirs": {
               k: {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1} for k in bench_offline.KEYS}}},
           "info": {"llamacpp": {"version": "0.0-test", "isa": "AVX2",
                                 "fallback": peer.fallback}},
           "sizes": {"a": [3, 5]}}
    assert any("fallback" in line for line in bench_offline._llamacpp_lines(res))


def test_worker_crash_after_serving_is_an_error(fake_venv: Path, tmp_path: Path) -> None:
    """A worker that dies after it has answered is not retried: the bench fails, saying so."""
    with llamacpp_peer.LlamaCppPeer(tmp_path / "m.gguf", 2, 64, venv=fake_venv) as peer:
        peer.generate([1, 2], 2)
        peer.proc.kill()
        peer.proc.wait()
        with pytest.raises(llamacpp_peer.LlamaCppUnavailable, match="exited"):
            peer.generate([1, 2], 2)
        assert peer.fallback is None


def test_missing_venv_says_how_to_build(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TPLLM_LLAMACPP_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(llamacpp_peer.LlamaCppUnavailable, match="make llamacpp"):
        llamacpp_peer.venv_python()


def test_compare_only_runs_the_default_gguf() -> None:
    with pytest.raises(llamacpp_peer.LlamaCppUnavailable, match="default model"):
        bench_offline.gguf_of("/some/hf/dir")


class _Out:
    def __init__(self, tokens, ttft, e2e):
        self.token_ids, self.metrics = tokens, {"ttft_s": ttft, "e2e_s": e2e}


class _FakeLLM:
    """Records the order of calls; each run takes 'ttft' 1 and 'e2e' 4 (TPOT 1 over 4 tokens)."""

    def __init__(self, log: list):
        self.log, self.n = log, 0

    @property
    def stats(self) -> dict:
        return {"steps": self.n}

    def generate(self, prompts, sp):
        self.log.append(("ours", prompts[0][0]))
        self.n += 1
        return [_Out([7, 8, 9, 10][:sp.max_tokens], 1.0, 4.0)]


class _FakePeer:
    def __init__(self, log: list):
        self.log = log

    def generate(self, prompt, n):
        self.log.append(("peer", prompt[0]))
        return {"ttft_s": 2.0, "e2e_s": 8.0, "token_ids": [7, 8, 0, 10][:n]}


def test_paired_rounds_alternate_and_count_agreement() -> None:
    log: list = []
    prompts = [[0], [1], [2], [3]]
    ours, theirs = bench_offline.paired_single(_FakeLLM(log), _FakePeer(log), prompts, 4)
    # both systems run every prompt back to back, the first of each pair alternating; prompt 0
    # is the uncounted warm-up of both
    assert log == [("ours", 0), ("peer", 0), ("peer", 1), ("ours", 1), ("ours", 2), ("peer", 2),
                   ("peer", 3), ("ours", 3)]
    assert ours["tpot_s"]["n"] == theirs["tpot_s"]["n"] == 3
    assert ours["tpot_s"]["median"] == pytest.approx(1.0)
    assert theirs["tpot_s"]["median"] == pytest.approx(2.0)
    assert ours["engine_stats"]["steps"] == 3  # the counted rounds only
    ratio = theirs["ours_over_theirs"]  # per paired round
    assert ratio["tpot_s"]["n"] == 3 and ratio["tpot_s"]["median"] == pytest.approx(0.5)
    assert ratio["ttft_s"]["median"] == pytest.approx(0.5)
    agree = [bench_offline._common_prefix(x, y)
             for x, y in zip(ours["raw"]["token_ids"], theirs["raw"]["token_ids"])]
    assert agree == [2, 2, 2]


def test_compare_argument_lists_peers() -> None:
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "client", "bench", "offline", "--compare", *a, "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run("hf,llamacpp").returncode == 0
    bad = run("hf,vllm")
    assert bad.returncode == 2 and "expected hf, llamacpp or both" in bad.stderr


@pytest.mark.skipif(not (ROOT / ".venv-llamacpp" / "bin" / "python").exists(),
                    reason="llama.cpp is not built here (`make llamacpp`: several minutes)")
def test_real_llamacpp_decodes_the_default_gguf() -> None:
    """With the real build: the default model's GGUF decodes a few greedy tokens."""
    gguf = bench_offline.gguf_of(None)
    with llamacpp_peer.LlamaCppPeer(gguf, 2, 64) as peer:
        got = peer.generate([1, 2, 3, 4], 4)
    assert len(got["token_ids"]) == 4 and all(isinstance(t, int) for t in got["token_ids"])
    assert "AVX2" in llamacpp_peer.isa_line(peer.info["system_info"]) or os.uname().machine != \
        "x86_64"
