"""A tiny run of `python -m client soak` (the full 1,000-request soak is a benchmark, not a test)."""
from __future__ import annotations

import json

import pytest

from client.__main__ import build_parser

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_soak_smoke(server, tmp_path):
    from client import soak
    out = tmp_path / "soak.json"
    args = build_parser().parse_args([
        "soak", "--requests", "24", "--concurrency", "8", "--cancel-fraction", "0.25",
        "--invalid-fraction", "0.1", "--max-tokens", "4", "12", "--prompt-words", "4", "40",
        "--grpc-url", server.grpc_url, "--http-url", server.http_url,
        "--metrics-url", f"localhost:{server.metrics_port}", "--server-pid", str(server.proc.pid),
        "--out", str(out)])
    assert soak.main(args) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 24 and report["unexplained"] == 0, report
    assert report["expected_errors"]["cancelled"] > 0 and report["expected_errors"]["invalid"] > 0
    assert report["kv_blocks_used_end"] == 0 and report["rss"] is not None
