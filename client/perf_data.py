"""The ready `--input-data` file for perf_analyzer / genai-perf runs against model `llm`.

    python -m client.perf_data [--input-len 1024] [--output-len 64] [--out client/perf_data_1024_64.json]

One request: a prompt of exactly `--input-len` tokens of the served tokenizer (the default
SmolLM2), `max_tokens` = `--output-len`, `ignore_eos` (every request generates exactly that many
tokens), greedy, `stream: true` (one response per token: what perf_analyzer's
`--streaming` measures). The committed file is what this writes with the defaults.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from client.perf_analyzer import INPUT_DATA
from client.serve_overhead import make_prompts


def input_data(prompt: str, max_tokens: int) -> dict:
    """perf_analyzer's --input-data JSON: one entry, every input a list (its shape [1])."""
    return {"data": [{"text_input": [prompt], "max_tokens": [max_tokens], "ignore_eos": [True],
                      "temperature": [0.0], "stream": [True]}]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.perf_data", description=__doc__)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", type=Path, default=INPUT_DATA)
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    from backend.model.gguf_import import default_model_dir
    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    prompt = make_prompts(tok, 1, a.input_len)[0]
    n = len(tok.encode(prompt))
    a.out.write_text(json.dumps(input_data(prompt, a.output_len), indent=1) + "\n")
    print(f"{a.out}: prompt of {n} tokens, max_tokens {a.output_len}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
