"""The C++ CPU kernels' ISA variants (tpllm_kernels/cpu_ext.py): each variant this CPU can run,
forced with TPLLM_CPU_ISA in its own process, matches the torch reference, and every variant computes
the same float32 results (bit for bit: kernels, logits and greedy tokens of a tiny model with
head_dim 64, the hand-tiled size) and bfloat16 logits within transformers' own bf16 error (the
AVX512-BF16 GEMV sums pairs of products with vdpbf16ps, the others widen to float32 FMAs).
Variants this CPU cannot run are skipped, saying so."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tpllm_kernels import cpu_ext

ROOT = Path(__file__).resolve().parent.parent
SIMD_VARIANTS = [v.name for v in cpu_ext.X86_VARIANTS]


def _kernel_outputs() -> dict[str, torch.Tensor]:
    """Each hand-written kernel on fixed inputs, checked against the torch reference here."""
    from tpllm_kernels import cpu_ops
    from tpllm_kernels import reference as ref
    from tpllm_kernels.metadata import DecodeBatch, PrefillChunk

    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    # GEMV: K not a multiple of 16, N not of 4, 1..5 rows
    w, x = torch.randn(37, 200, generator=g), torch.randn(5, 200, generator=g)
    for m in (1, 3, 5):
        out[f"linear{m}"] = got = cpu_ops.linear(x[:m].contiguous(), w)
        torch.testing.assert_close(got, ref.linear(x[:m], w), rtol=1e-5, atol=1e-4)
    # exact block copies of Q4_1 and Q8_0 weights (cpu_blocks.py): the float32 GEMV's bits;
    # 2 rows past the last 4-row tile
    from tests.tiny_models import gguf_round_trip
    xb = torch.randn(5, 224, generator=g)
    for kind in ("Q4_1", "Q8_0"):
        wb = gguf_round_trip(torch.randn(38, 224, generator=g), kind)
        plain = {m: cpu_ops.linear(xb[:m].contiguous(), wb) for m in (1, 3, 5)}
        assert cpu_ops.keep_block_copy(wb) > 0 and wb.block_copy[0] == kind[:2].lower()
        for m in (1, 3, 5):
            out[f"linear_{kind}_{m}"] = got = cpu_ops.linear(xb[:m].contiguous(), wb)
            assert torch.equal(got.view(torch.int32), plain[m].view(torch.int32))
    out["linear_bf16"] = got = cpu_ops.linear(x[:1].bfloat16(), w.bfloat16())
    torch.testing.assert_close(got.float(), ref.linear(x[:1].bfloat16(), w.bfloat16()).float(),
                               rtol=2e-2, atol=2e-2)
    # greedy screening (a head's int8 or bf16 copy, then the rows that can win): linear's argmax and
    # logit, bit for bit, on every variant with a bf16 GEMV (all but the portable build, which
    # builds no screen: its heads run whole)
    from backend.model.greedy_head import GreedyScreen
    head, xs = torch.randn(4099, 224, generator=g) * 0.05, torch.randn(3, 224, generator=g)
    full = cpu_ops.linear(xs, head)
    head16, xs16 = head.bfloat16(), xs[:2].bfloat16()
    if cpu_ext.isa_level() == "generic":
        assert not cpu_ops.GREEDY_SCREEN and GreedyScreen.build(head, cpu_ops, "q8") is None
    else:
        for kind in ("q8", "bf16"):  # int8 groups or bf16 copy
            screen = GreedyScreen.build(head, cpu_ops, kind)
            assert screen is not None
            tokens, out[f"greedy_logit_{kind}"], _ = screen.screen(xs, head)
            out[f"greedy_token_{kind}"] = tokens
            assert torch.equal(tokens, full.argmax(dim=1))
            assert torch.equal(out[f"greedy_logit_{kind}"],
                               full.gather(1, tokens[:, None])[:, 0])
        # a bf16 head's screen: this variant's bf16 linear + argmax (its sums differ between
        # variants within bf16's tolerance, so checked here, not across variants)
        full16 = cpu_ops.linear(xs16, head16).float()
        tokens, values, _ = GreedyScreen.build(head16, cpu_ops).screen(xs16, head16)
        assert torch.equal(tokens, full16.argmax(dim=1))
        assert torch.equal(values, full16.gather(1, tokens[:, None])[:, 0])
    # decode attention, head_dim 64 (the two-pass kernel), 3 query heads per KV head, splits
    B, Hq, Hkv, D, BS, NB = 3, 6, 2, 64, 16, 24
    kc, vc = torch.randn(NB, BS, Hkv, D, generator=g), torch.randn(NB, BS, Hkv, D, generator=g)
    tables = torch.randperm(NB, generator=g)[:B * 8].view(B, 8)
    lens = torch.tensor([5, 77, 128])
    q = torch.randn(B, Hq, D, generator=g)
    batch = DecodeBatch(tables, lens, int(lens.max()), BS)
    for dtype in (torch.float32, torch.bfloat16):
        for splits in (1, 3):
            args = (q.to(dtype), kc.to(dtype), vc.to(dtype), batch, 0.125)
            out[f"attn_{dtype}_{splits}"] = got = cpu_ops.decode_attention(*args, num_splits=splits)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), ref.decode_attention(*args).float(),
                                       rtol=tol, atol=tol)
    # prefill attention over a cached prefix (the chunk's 20 tokens after 45 cached ones)
    T, ctx = 20, 65
    qp = torch.randn(T, Hq, D, generator=g)
    chunk = PrefillChunk(0, T, ctx, tables[2])
    kk, vv = kc[tables[2]].flatten(0, 1)[ctx - T:ctx], vc[tables[2]].flatten(0, 1)[ctx - T:ctx]
    out["prefill"] = got = cpu_ops.prefill_attention(qp, kk, vv, kc, vc, chunk, 0.125)
    want = ref.prefill_attention(qp, kk, vv, kc, vc, chunk, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the elementwise kernels
    h, res, nw = (torch.randn(4, 576, generator=g) for _ in range(3))
    out["rms_x"], out["rms_res"] = cpu_ops.add_rms_norm(h.clone(), res.clone(), nw, 1e-5)
    out["rms_only"] = cpu_ops.rms_norm(h, nw[0].contiguous(), 1e-5)
    out["silu"] = cpu_ops.silu_mul(torch.randn(4, 2 * 160, generator=g))
    return out


def _worker(variant: str, model_dir: str, out_path: str) -> None:
    """Runs in a process with TPLLM_CPU_ISA=variant: saves its kernels' outputs, a tiny model's
    float32 and bf16 logits and float32 greedy tokens."""
    from backend import LLM, SamplingParams
    from tests.test_model_fidelity import _our_logits

    assert cpu_ext.isa_level() == variant, cpu_ext.isa_level()
    torch.set_num_threads(2)
    result = {f"kernel/{k}": v for k, v in _kernel_outputs().items()}
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    for dtype in (torch.float32, torch.bfloat16):
        result[f"logits/{dtype}"] = _our_logits(Path(model_dir), ids, [7, 20, 5] + [1] * 8, dtype)
    llm = LLM(model=model_dir, num_kv_blocks=64, block_size=16, max_num_batched_tokens=64)
    prompts = [ids[:n] for n in (5, 33)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    result["tokens"] = torch.tensor([o.token_ids for o in outs])
    torch.save(result, out_path)


def _run(variant: str, model_dir: Path, out: Path) -> dict:
    env = {**os.environ, cpu_ext.ISA_ENV: variant}
    code = f"from tests.test_cpu_isa import _worker; _worker({variant!r}, {str(model_dir)!r}, " \
           f"{str(out)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def variant_results(tmp_path_factory):
    from tests.tiny_models import make_tiny_checkpoint
    tmp = tmp_path_factory.mktemp("isa")
    model_dir = make_tiny_checkpoint("llama", tmp / "model", hidden_size=192, num_heads=3,
                                     num_kv_heads=1)
    return {v: _run(v, model_dir, tmp / f"{v}.pt") for v in cpu_ext.runnable() if v in SIMD_VARIANTS}


def _skip_unless_runnable(variant: str) -> None:
    if not cpu_ext.can_run(cpu_ext._variant(variant)):
        missing = sorted(set(cpu_ext._variant(variant).cpu_flags) - cpu_ext.cpu_flags())
        pytest.skip(f"this CPU cannot run the {variant} kernels (no {', '.join(missing)})")


@pytest.mark.parametrize("variant", SIMD_VARIANTS)
def test_variant_matches_the_others(variant, variant_results):
    """Forced to `variant`, the kernels pass their reference checks (in _worker) and compute
    what the first runnable variant computes: float32 identically, bf16 logits within the
    transformers-bf16 tolerance (the fidelity test's 1e-2 of the logits' scale)."""
    _skip_unless_runnable(variant)
    base_name = next(iter(variant_results))
    base, got = variant_results[base_name], variant_results[variant]
    for key, want in base.items():
        if key == "logits/torch.bfloat16":
            scale = base["logits/torch.float32"].abs().max()
            err = ((got[key] - want).abs().max() / scale).item()
            assert err <= 1e-2, f"{variant} vs {base_name}: bf16 logits differ by {err:.2e}"
        elif key == "kernel/linear_bf16" and variant != base_name:
            torch.testing.assert_close(got[key].float(), want.float(), rtol=2e-2, atol=2e-2)
        else:  # float32 (and bf16 storage with float32 arithmetic): the same bits
            assert torch.equal(got[key], want), f"{variant} vs {base_name}: {key}"


def test_dispatch_picks_the_best_and_refuses_what_the_cpu_lacks(monkeypatch):
    """On an AVX2-only CPU (flags faked) the avx2 variant is chosen, TPLLM_CPU_ISA may force
    it, and forcing AVX-512 is an error naming the missing flags (never a SIGILL later)."""
    avx2_only = frozenset(cpu_ext._V3)
    monkeypatch.setattr(cpu_ext, "cpu_flags", lambda: avx2_only)
    monkeypatch.delenv(cpu_ext.ISA_ENV, raising=False)
    if not cpu_ext._IS_X86:
        pytest.skip("x86 variants only")
    assert cpu_ext.selected_variant().name == "avx2"
    assert cpu_ext.runnable() == ["avx2", "generic"]
    monkeypatch.setenv(cpu_ext.ISA_ENV, "AVX2")
    assert cpu_ext.selected_variant().name == "avx2"
    monkeypatch.setenv(cpu_ext.ISA_ENV, "avx512")
    with pytest.raises(RuntimeError, match="cannot run the avx512 kernels.*avx512f"):
        cpu_ext.selected_variant()
    monkeypatch.setenv(cpu_ext.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="must be one of"):
        cpu_ext.selected_variant()
    bf16_cpu = frozenset(cpu_ext._V4) | {"avx512_bf16", "avx512_vnni"}
    monkeypatch.setattr(cpu_ext, "cpu_flags", lambda: bf16_cpu)
    monkeypatch.delenv(cpu_ext.ISA_ENV)
    assert cpu_ext.selected_variant().name == "avx512_bf16"
    # the variant's head screen uses VNNI: a CPU without it takes the avx512 kernels
    monkeypatch.setattr(cpu_ext, "cpu_flags", lambda: bf16_cpu - {"avx512_vnni"})
    assert cpu_ext.selected_variant().name == "avx512"


def test_builds_are_keyed_by_flags_not_by_the_host(monkeypatch):
    """Each variant has its own build directory, named by the variant and a hash of sources
    and flags: the same on another host (no /proc/cpuinfo in the key)."""
    dirs = {v.name: cpu_ext._cache_dir(v) for v in cpu_ext.variants()}
    assert len(set(dirs.values())) == len(dirs)
    for name, d in dirs.items():
        assert d.name.startswith(name + "-")
    monkeypatch.setattr(cpu_ext, "cpu_flags", lambda: frozenset({"sse2"}))  # another host
    assert {v.name: cpu_ext._cache_dir(v) for v in cpu_ext.variants()} == dirs


def test_isa_level_is_reported():
    level = cpu_ext.isa_level()
    assert level in [v.name for v in cpu_ext.variants()] or level.startswith("none"), level
    json.dumps(level)


def test_bf16_without_native_bf16_is_flagged(monkeypatch):
    """The engine warns when bfloat16 is asked for on a CPU whose kernels widen bf16 to float32
    (AVX2, AVX-512 without BF16): measured there, its prefill is several times float32's."""
    from backend.engine.config import EngineConfig
    from backend.engine.llm_engine import LLMEngine
    for level, dtype, flagged in [("avx2", "bfloat16", True), ("avx512", "bfloat16", True),
                                  ("avx512_bf16", "bfloat16", False), ("avx2", "float32", False)]:
        monkeypatch.setattr(cpu_ext, "isa_level", lambda level=level: level)
        config = EngineConfig(dtype=dtype, device="cpu")
        assert LLMEngine.device_is_cpu_without_bf16(config.resolved_device(),
                                                    config.torch_dtype) is flagged, level


def test_setup_builds_only_what_this_cpu_runs(monkeypatch):
    """`python -m tpllm_kernels.cpu_ext` (make setup) builds the selected variant alone: on an
    AVX2-only CPU the AVX-512 variants, which cannot load there, are never compiled; `all` (an
    image for other hosts) names every x86 variant; a name is checked."""
    if not cpu_ext._IS_X86:
        pytest.skip("x86 variants only")
    monkeypatch.delenv(cpu_ext.ISA_ENV, raising=False)
    monkeypatch.setattr(cpu_ext, "cpu_flags", lambda: frozenset(cpu_ext._V3))
    assert cpu_ext._build_names([]) == ["avx2"]
    monkeypatch.setattr(cpu_ext, "cpu_flags",
                        lambda: frozenset(cpu_ext._V4) | {"avx512_bf16", "avx512_vnni"})
    assert cpu_ext._build_names([]) == ["avx512_bf16"]
    assert cpu_ext._build_names(["all"]) == SIMD_VARIANTS
    assert cpu_ext._build_names(["AVX2"]) == ["avx2"]
    with pytest.raises(ValueError, match="must be one of"):
        cpu_ext._build_names(["sse9"])
