"""The ready `--input-data` file for perf_analyzer / genai-perf runs against model `llm`.

    python -m client.perf_data [--input-len 1024] [--output-len 64] [--out client/perf_data_1024_64.json]
    python -m client.perf_data --summarize EXPORT.json   # a perf_analyzer --profile-export-file

One request: a prompt of exactly `--input-len` tokens of the served tokenizer (the default
SmolLM2), `max_tokens` = `--output-len`, `ignore_eos` (every request generates exactly that many
tokens), greedy, `stream: true` (one response per token: what perf_analyzer's
`--streaming` measures), and `return_cumulative_logprob` (below). The committed file is what
this writes with the defaults.

Why `return_cumulative_logprob`: perf_analyzer 2.51 (tritonclient 2.51.0's binary) records every
output of the model for every response, and for an output a response does not carry it records
whatever bytes it finds (seen: +-1e38, 2e23 in exports). Our optional outputs are sent only when
asked for, so the FP32 one (`cumulative_logprob`) was garbage on every streamed delta; when the
garbage was a NaN/Inf bit pattern, perf_analyzer's JSON writer stopped mid-document, its buffer
was never flushed, and `--profile-export-file` was left empty with exit status 0 (1 in ~8 runs of
tests/integration/test_perf_analyzer.py). Asking for the output puts a real,
finite value on every response; it costs one log-sum-exp over the vocabulary per token.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from client.perf_analyzer import INPUT_DATA
from client.serve_overhead import make_prompts


def input_data(prompt: str, max_tokens: int) -> dict:
    """perf_analyzer's --input-data JSON: one entry, every input a list (its shape [1])."""
    return {"data": [{"text_input": [prompt], "max_tokens": [max_tokens], "ignore_eos": [True],
                      "temperature": [0.0], "stream": [True],
                      "return_cumulative_logprob": [True]}]}


def summarize_export(path: Path) -> dict:
    """Per-request TTFT / mean ITL / e2e and the throughputs of a perf_analyzer profile export
    (request send time and every response's arrival, ns), which its console report lacks."""
    reqs = [r for e in json.loads(Path(path).read_text())["experiments"] for r in e["requests"]
            if r["response_timestamps"]]
    first = [r["response_timestamps"][0] - r["timestamp"] for r in reqs]
    itl = [(r["response_timestamps"][-1] - r["response_timestamps"][0])
           / (len(r["response_timestamps"]) - 1) for r in reqs if len(r["response_timestamps"]) > 1]
    wall = (max(r["response_timestamps"][-1] for r in reqs) - min(r["timestamp"] for r in reqs)) / 1e9
    return {"requests": len(reqs), "req_s": len(reqs) / wall,
            "responses_s": sum(len(r["response_timestamps"]) for r in reqs) / wall,
            "ttft_s": statistics.mean(first) / 1e9,
            "itl_ms": statistics.mean(itl) / 1e6 if itl else None,
            "e2e_s": statistics.mean(r["response_timestamps"][-1] - r["timestamp"]
                                     for r in reqs) / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.perf_data", description=__doc__)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", type=Path, default=INPUT_DATA)
    p.add_argument("--summarize", type=Path, default=None, metavar="EXPORT",
                   help="print TTFT/ITL/e2e of a perf_analyzer --profile-export-file and exit")
    a = p.parse_args(argv)
    if a.summarize:
        print(json.dumps(summarize_export(a.summarize), indent=1))
        return 0
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
