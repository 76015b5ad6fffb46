"""Prefix caching through the real server: the counters, num_cached_tokens, and a cancelled
request that shares blocks with another leaves the other's stream intact."""
from __future__ import annotations

import queue
import threading

import pytest

from client.generate import generate, grpc_inputs

pytestmark = pytest.mark.integration
BLOCK = 16  # the shared server's block_size (config.pbtxt default)
# unique to this module, so no other test has cached it
SYSTEM = ("Prefix cache check. You are a terse assistant for the Lighthouse Museum of Nowhere "
          "Bay. Visitors ask about opening hours, the lamp room, the fog horn, the gift shop "
          "and the ferry. Answer in one sentence. Question: ")
KV = "llm_kv_cache_blocks_used"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from backend.model.gguf_import import default_model_dir
    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def _expected_cached(cached_ids: list[int], ids: list[int]) -> int:
    """Full blocks of the common prefix, never the prompt's last token."""
    common = 0
    for a, b in zip(cached_ids, ids):
        if a != b:
            break
        common += 1
    return min(common, len(ids) - 1) // BLOCK * BLOCK


def test_counters_and_num_cached_tokens(server, tokenizer, greedy):
    # the baselines from one settled scrape: an earlier refresh's values would count the
    # requests before this test as this test's
    base = server.settled_metrics(("llm_prefix_cache_queries_total",
                                   "llm_prefix_cache_hits_total",
                                   "llm_engine_scheduled_tokens_total"))
    q0, h0, s0 = base.values()
    prompts = [SYSTEM + "When does the museum open?", SYSTEM + "Can I climb to the lamp room?"]
    ids = [tokenizer.encode(p) for p in prompts]
    fields = {"max_tokens": 12, "temperature": 0.0, "return_num_cached_tokens": True,
              "exclude_input_in_output": True}
    first = generate({"text_input": prompts[0], **fields}, "grpc", server.grpc_url)
    second = generate({"text_input": prompts[1], **fields, "stream": True}, "http",
                      server.http_url)
    want = _expected_cached(ids[0], ids[1])
    assert want >= 2 * BLOCK
    assert (first["num_cached_tokens"], second["num_cached_tokens"]) == (0, want)
    assert [first["text"], second["text"]] == greedy.many(prompts, 12)
    assert server.wait_metric("llm_prefix_cache_queries_total",
                              lambda v: v >= q0 + len(ids[0]) + len(ids[1])) == \
        q0 + len(ids[0]) + len(ids[1])
    assert server.wait_metric("llm_prefix_cache_hits_total", lambda v: v >= h0 + want) == h0 + want
    # through the model: both prompts but the cached blocks, then a decode row per token after
    # each request's first (greedy: they may stop before max_tokens)
    ran = len(ids[0]) + len(ids[1]) - want + sum(int(o["num_output_tokens"]) - 1
                                                 for o in (first, second))
    assert server.wait_metric("llm_engine_scheduled_tokens_total",
                              lambda v: v >= s0 + ran) == s0 + ran
    without = generate({"text_input": prompts[1], "max_tokens": 2}, "grpc", server.grpc_url)
    assert "num_cached_tokens" not in without  # only when asked for
    cold = server.settled_metrics(("llm_cold_path_events_total",))
    assert cold["llm_cold_path_events_total"] == 0


def test_cancel_of_a_sharer_leaves_the_other_stream_intact(server, greedy):
    import tritonclient.grpc as grpcclient
    prompt = SYSTEM + "Tell me the whole history of the fog horn."
    server.wait_metric(KV, lambda v: v == 0)
    want = greedy(prompt, 48, ignore_eos=True)
    generate({"text_input": prompt, "max_tokens": 1}, "grpc", server.grpc_url)  # cache it
    kept: dict = {}
    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer("llm", grpc_inputs({
        "text_input": prompt, "max_tokens": 2000, "ignore_eos": True, "temperature": 0.0,
        "stream": True}))
    result, error = q.get(timeout=120)  # the victim runs, on the shared blocks
    assert error is None

    running = threading.Event()

    def keep():
        kept.update(generate({"text_input": prompt, "max_tokens": 48, "ignore_eos": True,
                              "temperature": 0.0, "stream": True,
                              "return_num_cached_tokens": True}, "grpc", server.grpc_url,
                             on_text=lambda _: running.set()))
    t = threading.Thread(target=keep)
    t.start()
    assert running.wait(120)  # both stream now, sharing the prompt's cached blocks
    client.stop_stream(cancel_requests=True)  # cancelled while the keeper shares its prefix
    client.close()
    t.join(300)
    assert kept["text"] == want and kept["finish_reason"] == "length"
    assert kept["num_cached_tokens"] > 0
    assert server.wait_metric(KV, lambda v: v == 0, timeout=30) == 0
