"""llama.cpp as a benchmark peer, run by the interpreter of its own venv (`make llamacpp`): this
file imports nothing of ours and no torch, so llama-cpp-python's native build and its pins stay
out of the engine's environment.

Protocol: argv = GGUF path, threads, context length[, "no-extra-bufts"]. One JSON object per
line on stdin, one per line on stdout:
  {"op": "info"}                                  -> {"version", "system_info"}
  {"op": "generate", "prompt": [ids], "n": N}     -> {"ttft_s", "e2e_s", "token_ids"}
  {"op": "quit"}
`generate` starts from an empty KV cache (no reuse of an earlier prompt's prefix), feeds the token
ids as given and decodes exactly N tokens greedily, end-of-sequence included, as the engine's
ignore_eos does. TTFT is the prompt's evaluation plus the first token; e2e ends at the N-th.
"""
from __future__ import annotations

import json
import sys
import time


def main() -> int:
    import llama_cpp

    path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if "no-extra-bufts" in sys.argv[4:]:
        without_extra_buffer_types(llama_cpp)
    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                          n_ctx=n_ctx, n_batch=min(n_ctx, 2048), verbose=False)
    out = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        if req["op"] == "info":
            info = llama_cpp.llama_print_system_info()
            reply = {"version": llama_cpp.__version__,
                     "system_info": info.decode() if isinstance(info, bytes) else str(info)}
        else:
            reply = generate(llm, req["prompt"], req["n"])
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


def without_extra_buffer_types(llama_cpp) -> None:
    """Loads the model with llama.cpp's `use_extra_bufts` off: its weights stay in the plain CPU
    buffer, so no AMX (or repacked) matmul runs. llama_cpp.Llama has no argument for it, so the
    default parameters it starts from are wrapped."""
    import llama_cpp.llama as module

    defaults = module.llama_cpp.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    module.llama_cpp.llama_model_default_params = params


def generate(llm, prompt: list[int], n: int) -> dict:
    llm.reset()  # an empty cache: generate() would otherwise reuse the last prompt's prefix
    tokens: list[int] = []
    t0 = time.perf_counter()
    ttft = None
    # greedy: top_k 1 at temperature 0; generate() yields every token, EOS included, until the
    # caller stops
    for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                            reset=True):
        if ttft is None:
            ttft = time.perf_counter() - t0
        tokens.append(int(tok))
        if len(tokens) == n:
            break
    e2e = time.perf_counter() - t0
    return {"ttft_s": ttft, "e2e_s": e2e, "token_ids": tokens}


if __name__ == "__main__":
    sys.exit(main())
