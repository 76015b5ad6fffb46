"""genai-perf 0.0.16 (optional: `make genai-perf`), as a user runs it against our server with both
of its Triton payloads (`--backend tensorrtllm`: input tensors; `--backend vllm`:
sampling_parameters JSON), streaming: a short profile finishes, measures what was asked (input
and output lengths) and the server counted the requests it sent."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from client.perf_analyzer import genai_perf_binary  # noqa: F401 (the entry point under test)
from client.perf_analyzer import GENAI_PERF_VENV
from client.server import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not (GENAI_PERF_VENV / "bin" / "genai-perf").exists(),
                                 reason="optional: `make genai-perf` installs genai-perf")]
INPUT_LEN, OUTPUT_LEN, REQUESTS = 64, 8, 4


@pytest.mark.parametrize("backend", ["tensorrtllm", "vllm"])
def test_genai_perf_profiles_each_backend(server, default_model_dir, tmp_path, backend):
    before = server.metric("llm_requests_total", default=0.0)
    cmd = [sys.executable, "-m", "client", "genai-perf", "profile", "-m", "llm",
           "--endpoint-type", "kserve", "--backend", backend, "--streaming",
           "-u", server.grpc_url, "--tokenizer", str(default_model_dir),
           "--synthetic-input-tokens-mean", str(INPUT_LEN), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(OUTPUT_LEN), "--output-tokens-mean-deterministic",
           "--extra-inputs", "ignore_eos:true", "--concurrency", "2",
           # perf_analyzer 2.51 and an output a response lacks: model_repository/README.md
           "--extra-inputs", "return_cumulative_logprob:true",
           "--request-count", str(REQUESTS), "--warmup-request-count", "0",
           "--artifact-dir", str(tmp_path / "artifacts")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    [export] = list((tmp_path / "artifacts").rglob("*_genai_perf.json"))
    stats = json.loads(export.read_text())
    assert stats["request_throughput"]["avg"] > 0
    assert stats["time_to_first_token"]["avg"] > 0 and stats["inter_token_latency"]["avg"] > 0
    # genai-perf counts output tokens by re-tokenizing the streamed text: within a token or two
    assert abs(stats["output_sequence_length"]["avg"] - OUTPUT_LEN) <= 2
    assert abs(stats["input_sequence_length"]["avg"] - INPUT_LEN) <= 2
    after = server.wait_metric("llm_requests_total", lambda v: v >= before + REQUESTS, timeout=30)
    assert after - before == REQUESTS
    assert server.metric("llm_requests_total", finish_reason="length") >= REQUESTS
