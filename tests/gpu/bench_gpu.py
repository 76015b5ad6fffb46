"""Short GPU benchmark (one NVIDIA GPU): prints one table. Run by tests/gpu/check.sh.

Rows: device-to-device copy bandwidth (the ceiling); paged decode attention at 4k context
(Triton vs the torch reference) as bandwidth and share of the copy; our engine end to end
(LLMEngine on CUDA, step by step, sampling included) at batch 1 (inter-token latency with and
without CUDA graphs) and at concurrency 64 (throughput); then the model's decode step alone at
batch 1 and 64 (torch ops eager, Triton eager, Triton + CUDA graph). The model has
SmolLM2-135M's exact shapes with random bf16 weights (latency does not depend on the values; the
real checkpoint is not on the GPU machine). Kernel rows are timed with CUDA events via
triton.testing.do_bench (median); engine rows with the host clock around each engine step.

Every section runs on its own (a failure becomes a row) within --budget-s: a section that
would not fit is skipped, and the table is printed in any case.
    python tests/gpu/bench_gpu.py [--budget-s 200]
    python tests/gpu/bench_gpu.py --dry-run     # CPU, tiny model: checks this script anywhere
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from backend.model.config import ModelConfig  # noqa: E402
from backend.model.llama import LlamaForCausalLM  # noqa: E402
from backend.model.rotary import RotaryTables  # noqa: E402
from backend.parallel.context import ParallelContext  # noqa: E402
from tpllm_kernels import reference, select_ops  # noqa: E402
from tpllm_kernels.cuda_graphs import GraphRunner, StaticInput  # noqa: E402
from tpllm_kernels.metadata import AttentionMetadata, DecodeBatch  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
SMOLLM2_135M = dict(model_type="llama", hidden_act="silu", hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                    max_position_embeddings=8192, vocab_size=49152, tie_word_embeddings=True,
                    bos_token_id=1, eos_token_id=2)
BLOCK = 16  # the engine's default KV block size
ROWS: list[tuple[str, str, str]] = []


def row(name: str, value: str, note: str = "") -> None:
    ROWS.append((name, value, note))
    print(f"  {name}: {value} {note}", flush=True)


def ms(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def copy_bandwidth() -> float:
    x = torch.randn(1 << 29, device=DEV, dtype=BF16)  # 1 GiB
    y = torch.empty_like(x)
    gbs = 2 * x.numel() * x.element_size() / ms(lambda: y.copy_(x)) / 1e6
    row("copy bandwidth (d2d, read+write)", f"{gbs:.0f} GB/s", "the ceiling")
    return gbs


def paged_tables(batch: int, blocks_each: int, g: torch.Generator) -> torch.Tensor:
    """Each sequence's blocks scattered at random over the pool (block 0 left unused)."""
    perm = torch.randperm(batch * blocks_each, generator=g) + 1
    return perm.view(batch, blocks_each).to(DEV)


def decode_attention_rows(copy_gbs: float) -> None:
    from tpllm_kernels import triton_ops
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, ctx = 9, 3, 64, 4096
    for b in (64, 1):
        tables = paged_tables(b, ctx // BLOCK, g)
        kc = torch.randn(b * ctx // BLOCK + 1, BLOCK, hkv, d, device=DEV, dtype=BF16)
        vc = torch.randn_like(kc)
        q = torch.randn(b, hq, d, device=DEV, dtype=BF16)
        batch = DecodeBatch(tables, torch.full((b,), ctx, device=DEV), ctx, BLOCK)
        out = triton_ops.decode_attention(q, kc, vc, batch, d ** -0.5)
        ref = reference.decode_attention(q, kc, vc, batch, d ** -0.5)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 1e-2, f"decode attention B={b}: relative error {err:.2e} vs the reference"
        kv_bytes = 2 * b * ctx * hkv * d * 2
        t = ms(lambda: triton_ops.decode_attention(q, kc, vc, batch, d ** -0.5))
        gbs = kv_bytes / t / 1e6
        note = f"{100 * gbs / copy_gbs:.0f}% of copy" + (" (target >= 70%)" if b == 64 else "")
        row(f"decode attn B={b} ctx={ctx} triton", f"{t * 1e3:.1f} us, {gbs:.0f} GB/s", note)
        t = ms(lambda: reference.decode_attention(q, kc, vc, batch, d ** -0.5))
        row(f"decode attn B={b} ctx={ctx} torch ref", f"{t * 1e3:.1f} us",
            f"{kv_bytes / t / 1e6:.0f} GB/s")
        del kc, vc


def build_model(ops) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dict(SMOLLM2_135M)
    with torch.device(DEV):
        model = LlamaForCausalLM(cfg, ParallelContext(), BF16, ops=ops)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.02)
    return model.eval()


def model_rows() -> None:
    from tpllm_kernels import triton_ops
    model = build_model(select_ops(DEV))
    assert model.ops is triton_ops, "CUDA must select the Triton kernels"
    torch_model = build_model(reference)
    torch_model.load_state_dict(model.state_dict())
    cfg = model.cfg
    max_b, ctx_max = 64, 1024
    blocks_each = ctx_max // BLOCK
    nb = max_b * blocks_each + 1
    shape = (nb, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape, device=DEV, dtype=BF16), torch.zeros(shape, device=DEV, dtype=BF16))
          for _ in range(cfg.num_layers)]
    rot = RotaryTables(cfg, ctx_max, BF16)
    cos, sin = rot.cos.to(DEV), rot.sin.to(DEV)
    rows_idx = torch.arange(max_b, device=DEV)

    def step_fn(m: LlamaForCausalLM, max_context: int):
        def step(ids, pos, slots, tables, lens):
            meta = AttentionMetadata(slots, cos.index_select(0, pos), sin.index_select(0, pos))
            meta.decode = DecodeBatch(tables, lens, max_context, BLOCK)
            return m(ids, meta, kv, rows_idx[:ids.shape[0]])
        return step

    all_tables = paged_tables(max_b, blocks_each, torch.Generator().manual_seed(1))

    def inputs(b: int, ctx: int):
        pos = torch.full((b,), ctx - 1, device=DEV)
        tables = all_tables[:b]
        slots = tables[:, (ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK
        ids = torch.randint(0, cfg.vocab_size, (b,), device=DEV)
        return ids, pos, slots, tables, torch.full((b,), ctx, device=DEV)

    specs = [StaticInput((), torch.int64), StaticInput((), torch.int64),
             StaticInput((), torch.int64, pad=0),  # padding rows write to scratch block 0
             StaticInput((blocks_each,), torch.int64), StaticInput((), torch.int64, pad=0)]
    graphs = GraphRunner(step_fn(model, ctx_max), [1, 2, 4, 8, 16, 32, 64], specs, DEV)
    at_warmup = graphs.num_captures
    for b, ctx in ((1, 128), (64, 512)):
        x = inputs(b, ctx)
        eager = step_fn(model, ctx)(*x)
        replay = graphs(*x).clone()
        ref = step_fn(torch_model, ctx)(*x)
        assert torch.allclose(replay, eager, rtol=1e-3, atol=1e-3), "graph replay != eager"
        err = ((eager - ref).norm() / ref.norm()).item()
        row(f"logits triton vs torch ops B={b}", f"{err:.1e}", "relative, bf16")
        t_torch = ms(lambda: step_fn(torch_model, ctx)(*x))
        t_eager = ms(lambda: step_fn(model, ctx)(*x))
        t_graph = ms(lambda: graphs(*x))
        if b == 1:
            row(f"ITL B=1 ctx={ctx} torch ops eager", f"{t_torch:.3f} ms")
            row(f"ITL B=1 ctx={ctx} triton eager", f"{t_eager:.3f} ms")
            row(f"ITL B=1 ctx={ctx} triton + CUDA graph", f"{t_graph:.3f} ms", "(target <= 1 ms)")
        else:
            row(f"decode step B={b} ctx={ctx} triton eager", f"{t_eager:.3f} ms",
                f"{b / t_eager * 1e3:.0f} tok/s")
            row(f"decode step B={b} ctx={ctx} triton + CUDA graph", f"{t_graph:.3f} ms",
                f"{b / t_graph * 1e3:.0f} tok/s")
            row(f"decode step B={b} ctx={ctx} torch ops eager", f"{t_torch:.3f} ms",
                f"{b / t_torch * 1e3:.0f} tok/s")
    row("CUDA graph captures after warmup", str(graphs.num_captures - at_warmup),
        f"({at_warmup} buckets captured at warmup)")
    assert graphs.num_captures == at_warmup, "captured again after warmup"


TINY = dict(SMOLLM2_135M, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)


def random_checkpoint(shapes: dict, dtype: torch.dtype, out: Path) -> Path:
    """A random HF Llama checkpoint with these shapes (safetensors, no tokenizer)."""
    import transformers as tf
    cfg = tf.LlamaConfig(**{k: v for k, v in shapes.items() if k != "model_type"})
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # fast random init
        model = tf.LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    return out


def engine_rows(model_dir: Path, device: str, dtype: str, prompt_len: int, gen: int,
                concurrency: int) -> None:
    """Our engine end to end: batch-1 ITL with and without CUDA graphs; throughput at
    `concurrency` (graphs on). Host clock around each step (sampling included)."""
    from backend import LLM, SamplingParams
    g = torch.Generator().manual_seed(0)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
               for _ in range(concurrency)]
    sp = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    for graphs in (True, False):
        t0 = time.perf_counter()
        with LLM(model=str(model_dir), dtype=dtype, device=device, cuda_graphs=graphs,
                 max_num_seqs=concurrency, max_num_batched_tokens=1024,
                 max_model_len=2 * (prompt_len + gen)) as llm:
            eng = llm.engine
            tag = "CUDA graphs" if eng.uses_cuda_graphs else "eager"
            row(f"engine load + warmup ({tag})", f"{time.perf_counter() - t0:.1f} s",
                f"{len(eng.warm_shapes)} buckets, {eng.runner.num_graph_captures} graphs")
            eng.add_request("itl", prompts[0], sp)
            steps = []
            while eng.has_unfinished():
                t = time.perf_counter()
                eng.step()
                steps.append(time.perf_counter() - t)
            itl = statistics.median(steps[1:]) * 1e3  # steps[0] is the prefill
            row(f"engine ITL B=1 ({tag})", f"{itl:.3f} ms",
                f"median of {len(steps) - 1} steps, {1e3 / itl:.0f} tok/s"
                + (" (target <= 1 ms)" if eng.uses_cuda_graphs else ""))
            if graphs:  # throughput at full concurrency, graphs on
                for i, p in enumerate(prompts):
                    eng.add_request(f"c{i}", p, sp)
                t, n, full = time.perf_counter(), 0, []
                while eng.has_unfinished():
                    ts = time.perf_counter()
                    k = len(eng.step())
                    n += k
                    if k == concurrency:
                        full.append(time.perf_counter() - ts)
                wall = time.perf_counter() - t
                row(f"engine throughput c={concurrency} ({tag})", f"{n / wall:.0f} tok/s",
                    f"{concurrency} x ({prompt_len} prompt + {gen} out) in {wall:.2f} s")
                if full:
                    row(f"engine step B={concurrency} ({tag})",
                        f"{statistics.median(full) * 1e3:.3f} ms", "median, all rows decoding")
            cold = eng.cold_path.snapshot()
            row(f"engine cold-path events after ready ({tag})", str(sum(cold.values())),
                str(cold) if cold else "")


def section(name: str, need_s: float, deadline: float, fn, *args) -> None:
    """Run one section if it fits the remaining budget; a failure becomes a row."""
    left = deadline - time.perf_counter()
    if left < need_s:
        row(name, "skipped", f"{left:.0f}s left of the budget, needs ~{need_s:.0f}s")
        return
    t0 = time.perf_counter()
    try:
        fn(*args)
    except Exception as e:
        traceback.print_exc()
        row(name, "FAILED", f"{type(e).__name__}: {str(e)[:120]}")
    print(f"  [{name}: {time.perf_counter() - t0:.1f}s]", flush=True)


def print_table() -> None:
    width = max([len(r[0]) for r in ROWS] + [10])
    print("\n" + "=" * 96)
    for name, value, note in ROWS:
        print(f"{name:<{width}}  {value:<24} {note}")
    print("=" * 96, flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench.json").write_text(json.dumps(ROWS, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting sections after")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, engine rows only")
    args = ap.parse_args()
    deadline = time.perf_counter() + args.budget_s
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.dry_run:
                section("engine (dry run, CPU)", 5, deadline, lambda: engine_rows(
                    random_checkpoint(TINY, torch.float32, Path(tmp, "tiny")), "cpu", "float32",
                    16, 8, 4))
                return 0 if not any(v == "FAILED" for _, v, _ in ROWS) else 1
            assert torch.cuda.is_available(), "no CUDA device"
            print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
            copy = [0.0]
            section("copy bandwidth", 5, deadline, lambda: copy.__setitem__(0, copy_bandwidth()))
            if copy[0]:
                section("decode attention", 15, deadline, decode_attention_rows, copy[0])
            section("engine", 60, deadline, lambda: engine_rows(
                random_checkpoint(SMOLLM2_135M, BF16, Path(tmp, "smollm2-shapes")), "cuda",
                "bfloat16", 128, 128, 64))
            section("model decode step", 30, deadline, model_rows)
    finally:
        print_table()
    return 1 if any(v == "FAILED" for _, v, _ in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
