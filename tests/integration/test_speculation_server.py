"""Speculative decoding through the real server: streamed greedy text equal to the offline
reference, several tokens per streamed response, the llm_spec_* counters, cold path 0."""
from __future__ import annotations

import pytest

from client.generate import generate

pytestmark = pytest.mark.integration

ITEMS = "apple river stone cloud maple tiger violet anchor pepper silver".split()


def _copy_prompt() -> str:
    from transformers import AutoTokenizer

    from backend.model.gguf_import import default_model_dir
    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    items = ", ".join(f"item {i}: {w}" for i, w in enumerate(ITEMS))
    return tok.apply_chat_template([{"role": "user", "content": f"Repeat this list exactly:\n{items}"}],
                                   tokenize=False, add_generation_prompt=True)


def test_streams_accepted_drafts_as_multi_token_responses(start_server, greedy):
    srv = start_server("speculation", params={"speculative_ngram": "4",
                                              "speculative_ngram_match": "3"})
    prompt = _copy_prompt()
    want = greedy(prompt, 48)
    fields = {"text_input": prompt, "max_tokens": 48, "temperature": 0.0, "stream": True,
              "exclude_input_in_output": True}
    for protocol, url in (("grpc", srv.grpc_url), ("http", srv.http_url)):
        out = generate(fields, protocol, url)
        assert out["text"] == want
        # accepted drafts arrive with the token after them: fewer responses than tokens
        assert out["num_output_tokens"] == 48 or out["finish_reason"] == "stop"
        assert out["responses"] < 0.8 * out["num_output_tokens"], out
    spec = srv.settled_metrics(("llm_spec_draft_tokens_total", "llm_spec_accepted_tokens_total",
                                "llm_cold_path_events_total"))
    assert 0 < spec["llm_spec_accepted_tokens_total"] <= spec["llm_spec_draft_tokens_total"], spec
    assert spec["llm_cold_path_events_total"] == 0
    srv.stop()
