"""Short GPU benchmark (one NVIDIA GPU): prints one table. Run by tests/gpu/check.sh.

Rows: device-to-device copy bandwidth (the ceiling); paged decode attention at 4k context
(Triton vs the torch reference) as bandwidth and share of the copy; SmolLM2-135M model decode
step at batch 1 (inter-token latency: torch ops eager, Triton eager, Triton + CUDA graph) and at
batch 64 (throughput). The model has SmolLM2-135M's exact shapes with random bf16 weights
(latency does not depend on the values; the real checkpoint is too large to carry here).
Timed with CUDA events via triton.testing.do_bench (median); inputs already on the device.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from backend.model.config import ModelConfig  # noqa: E402
from backend.model.llama import LlamaForCausalLM  # noqa: E402
from backend.model.rotary import RotaryTables  # noqa: E402
from backend.parallel.context import ParallelContext  # noqa: E402
from kernels import reference, select_ops, triton_ops  # noqa: E402
from kernels.cuda_graphs import GraphRunner, StaticInput  # noqa: E402
from kernels.metadata import AttentionMetadata, DecodeBatch  # noqa: E402

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


def main() -> int:
    assert torch.cuda.is_available(), "no CUDA device"
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    copy = copy_bandwidth()
    decode_attention_rows(copy)
    model_rows()
    width = max(len(r[0]) for r in ROWS)
    print("\n" + "=" * 88)
    for name, value, note in ROWS:
        print(f"{name:<{width}}  {value:<24} {note}")
    print("=" * 88)
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench.json").write_text(json.dumps(ROWS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
