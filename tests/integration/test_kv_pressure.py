"""More concurrent long requests than the KV pool holds: they queue or are preempted, and every
one finishes with the offline greedy output; none is lost or fails."""
from __future__ import annotations

import threading
import time

import pytest

from client.generate import generate

pytestmark = pytest.mark.integration
BLOCK = 16
NEW_TOKENS = 48


def test_more_long_requests_than_the_kv_pool_holds(start_server, greedy):
    prompts = [f"Tell a long story about a lighthouse keeper named Keeper{i}." for i in range(8)]
    # each request needs ceil((prompt + 48) / 16) = 5 blocks; 12 blocks hold two at a time
    srv = start_server("kv_pressure", params={"num_kv_blocks": "12", "block_size": str(BLOCK),
                                              "warmup": "false"})
    wants = greedy.many(prompts, NEW_TOKENS, ignore_eos=True)
    assert srv.metric("llm_kv_cache_blocks_total") == 12
    results: list = [None] * len(prompts)

    def run(i):
        try:
            results[i] = generate({"text_input": prompts[i], "max_tokens": NEW_TOKENS,
                                   "ignore_eos": True, "temperature": 0.0, "stream": i % 2 == 0,
                                   "exclude_input_in_output": True},
                                  "grpc" if i % 4 < 2 else "http",
                                  srv.grpc_url if i % 4 < 2 else srv.http_url)
        except Exception as e:  # reported below
            results[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    most_waiting = 0
    while any(t.is_alive() for t in threads):
        most_waiting = max(most_waiting, srv.metric("llm_num_requests_waiting"))
        assert srv.metric("llm_kv_cache_blocks_used") <= 12
        time.sleep(0.2)
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors
    assert [r["text"] for r in results] == wants
    assert all(r["num_output_tokens"] == NEW_TOKENS for r in results)
    preempted = srv.metric("llm_preemptions_total")
    assert most_waiting > 0 or preempted > 0, "the pool was never short: shrink it"
    assert srv.wait_metric("llm_kv_cache_blocks_used", lambda v: v == 0) == 0
    assert srv.metric("llm_requests_total", finish_reason="length") == len(prompts)
    # warmup off: the steps above ran shapes never seen before, and the server's counter says so
    # (the twin of test_streaming's "0 after a warmed start": that check reads a live series)
    assert srv.wait_metric("llm_cold_path_events_total", lambda v: v > 0) > 0
    print(f"most waiting {most_waiting:.0f}, preemptions {preempted:.0f}")
    srv.stop()
