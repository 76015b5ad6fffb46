"""Every Triton kernel against its torch reference (tpllm_kernels/reference.py) on random inputs.

Without a GPU the kernels run in Triton's interpreter on CPU tensors; on a CUDA machine (no
TRITON_INTERPRET) the same tests run compiled, on CUDA tensors (tests/gpu/check.sh).
The interpreter executes each program in Python: shapes are small and blocks large.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from tests.triton_env import DEVICE, interpreter_missing  # noqa: E402  (sets TRITON_INTERPRET)

pytest.importorskip("triton")

from tpllm_kernels import reference as R  # noqa: E402
from tpllm_kernels import triton_ops as T  # noqa: E402
from tpllm_kernels.cuda_graphs import GraphRunner, StaticInput  # noqa: E402
from tpllm_kernels.metadata import DecodeBatch, PrefillChunk  # noqa: E402

if interpreter_missing():
    pytest.skip("Triton was imported before TRITON_INTERPRET was set", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]
# the interpreter truncates (not rounds) when casting to bf16: allow ~one bf16 step beyond torch
TOL = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _gen(*key) -> torch.Generator:
    """A generator seeded per test case: different data per case, reproducible across runs."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(g: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def _close(actual: torch.Tensor, expected: torch.Tensor, **tol) -> None:
    assert not actual.isnan().any(), "NaN in kernel output"
    torch.testing.assert_close(actual, expected, **(tol or TOL[actual.dtype]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (37, 99), (130, 576)])
def test_rms_norm_and_add(dtype, rows, hidden):
    g = _gen(rows, hidden, str(dtype))
    x, r = _randn(g, rows, hidden, dtype=dtype), _randn(g, rows, hidden, dtype=dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype=dtype, device=DEVICE)
    _close(T.rms_norm(x, w, 1e-5), R.rms_norm(x, w, 1e-5))
    r_before = r.clone()
    out, res = T.add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_res = R.add_rms_norm(x, r, w, 1e-5)
    _close(res, ref_res)
    _close(out, ref_out)
    assert torch.equal(r, r_before), "add_rms_norm must not modify the caller's residual"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (13, 77), (70, 1536)])
def test_silu_mul(dtype, rows, inter):
    gu = _randn(_gen(rows, inter, str(dtype)), rows, 2 * inter, dtype=dtype) * 3
    _close(T.silu_mul(gu), R.silu_mul(gu))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hkv,d", [(1, 3, 1, 64), (11, 6, 2, 16), (33, 9, 3, 64),
                                             (5, 8, 1, 128)])
def test_rotary_in_place_on_qkv_view(dtype, tokens, hq, hkv, d):
    g = _gen(tokens, hq, d, str(dtype))
    qkv = _randn(g, tokens, (hq + 2 * hkv) * d, dtype=dtype)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    ang = torch.rand(tokens, d // 2, generator=g) * 50
    cos = torch.cat([ang.cos()] * 2, -1).to(dtype=dtype, device=DEVICE)
    sin = torch.cat([ang.sin()] * 2, -1).to(dtype=dtype, device=DEVICE)
    x = qkv[:, :(hq + hkv) * d].view(tokens, hq + hkv, d)  # strided, as the model passes it
    ref = R.rotary(x.clone(), cos, sin)
    out = T.rotary(x, cos, sin)
    assert out.data_ptr() == x.data_ptr()
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=1.6e-2, atol=3e-2)
    _close(out, ref, **tol)
    _close(x, ref, **tol)  # in place
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before), "v must be untouched"


def _paged(g: torch.Generator, lens: list[int], block_size: int, hkv: int, d: int,
           dtype: torch.dtype):
    """A KV cache with the sequences' blocks scattered at random, and their block tables."""
    need = [-(-n // block_size) for n in lens]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=g).tolist()
    tables = [[perm.pop() for _ in range(k)] for k in need]
    width = max(need)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    kc = _randn(g, nb, block_size, hkv, d, dtype=dtype)
    vc = _randn(g, nb, block_size, hkv, d, dtype=dtype)
    return kc, vc, bt.to(DEVICE), [torch.tensor(t, device=DEVICE) for t in tables]


# (query heads, kv heads, head dim, block size, context lengths): GQA ratios 1, 3 and 8,
# odd block sizes, partial last blocks, one-token contexts, a non-power-of-two head dim.
DECODE_CASES = [
    (4, 4, 64, 16, [1, 16, 40]),
    (6, 2, 16, 5, [3, 17, 33, 9, 25]),
    (16, 2, 32, 4, [70, 7]),
    (9, 3, 40, 7, [29, 1, 50]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("hq,hkv,d,bs,lens", DECODE_CASES)
def test_decode_attention(dtype, splits, hq, hkv, d, bs, lens):
    g = _gen(hq, d, bs, splits, str(dtype))
    kc, vc, bt, _ = _paged(g, lens, bs, hkv, d, dtype)
    batch = DecodeBatch(bt, torch.tensor(lens, device=DEVICE), max(lens), bs)
    q = _randn(g, len(lens), hq, d, dtype=dtype)
    out = T.decode_attention(q, kc, vc, batch, d ** -0.5, num_splits=splits)
    _close(out, R.decode_attention(q, kc, vc, batch, d ** -0.5))


def test_decode_attention_uneven_gqa_and_padding_rows():
    """kv_index (TP's uneven head split) and zero-length rows (CUDA-graph padding) -> zeros."""
    g = _gen("uneven")
    hq, hkv, d, bs, lens = 5, 2, 32, 8, [19, 40, 0]
    kc, vc, bt, _ = _paged(g, [19, 40, 1], bs, hkv, d, torch.float32)
    kv_index = torch.tensor([0, 0, 0, 1, 1], device=DEVICE)
    q = _randn(g, 3, hq, d)
    for splits in (1, 2):
        batch = DecodeBatch(bt, torch.tensor(lens, device=DEVICE), 40, bs)
        out = T.decode_attention(q, kc, vc, batch, d ** -0.5, kv_index, num_splits=splits)
        ref_batch = DecodeBatch(bt[:2], torch.tensor(lens[:2], device=DEVICE), 40, bs)
        _close(out[:2], R.decode_attention(q[:2], kc, vc, ref_batch, d ** -0.5, kv_index))
        assert torch.equal(out[2], torch.zeros_like(out[2]))


# (query heads, kv heads, head dim, block size, [(chunk length, context length)])
PREFILL_CASES = [
    (4, 4, 64, 16, [(37, 37)]),  # no cached prefix
    (6, 2, 16, 5, [(12, 33), (1, 9)]),  # chunks over a cached prefix, a one-token chunk
    (16, 2, 32, 4, [(20, 20), (9, 60)]),
    (9, 3, 40, 7, [(30, 45)]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,bs,chunks", PREFILL_CASES)
def test_prefill_attention(dtype, hq, hkv, d, bs, chunks):
    g = _gen(hq, d, bs, str(dtype), "prefill")
    kc, vc, _, tables = _paged(g, [c for _, c in chunks], bs, hkv, d, dtype)
    scale = d ** -0.5
    metas, start = [], 0
    for (n, ctx), table in zip(chunks, tables):
        metas.append(PrefillChunk(start, n, ctx, table))
        start += n
    q = _randn(g, start, hq, d, dtype=dtype)
    refs = []
    for c in metas:  # the chunk's own k/v, as the model passes them (already in the cache)
        k = kc.index_select(0, c.block_table).flatten(0, 1)[c.context_len - c.length:c.context_len]
        v = vc.index_select(0, c.block_table).flatten(0, 1)[c.context_len - c.length:c.context_len]
        qc = q[c.start:c.start + c.length]
        refs.append(R.prefill_attention(qc, k, v, kc, vc, c, scale))
        _close(T.prefill_attention(qc, k, v, kc, vc, c, scale), refs[-1])
    out = torch.full_like(q, float("nan"))  # every row must be written
    T.prefill_attention_varlen(q, kc, vc, metas, scale, out=out)
    _close(out, torch.cat(refs))


def test_prefill_attention_uneven_gqa():
    g = _gen("prefill-uneven")
    hq, hkv, d, bs = 5, 2, 32, 8
    kc, vc, _, (table,) = _paged(g, [26], bs, hkv, d, torch.float32)
    kv_index = torch.tensor([0, 0, 0, 1, 1], device=DEVICE)
    c = PrefillChunk(0, 10, 26, table)
    q = _randn(g, 10, hq, d)
    k = kc.index_select(0, table).flatten(0, 1)[16:26]
    v = vc.index_select(0, table).flatten(0, 1)[16:26]
    _close(T.prefill_attention(q, k, v, kc, vc, c, d ** -0.5, kv_index),
           R.prefill_attention(q, k, v, kc, vc, c, d ** -0.5, kv_index))


def test_graph_runner_buckets_and_padding():
    """The bucket/static-buffer logic (CUDA graphs replay it on GPU; here it runs eagerly)."""
    calls = []

    def step(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return x * 2 + lens[:, None]

    runner = GraphRunner(step, [1, 4, 8], [StaticInput((3,), torch.float32),
                                           StaticInput((), torch.int64, pad=0)],
                         DEVICE, use_graphs=DEVICE == "cuda")
    for n in (1, 3, 8, 2):
        x, lens = torch.randn(n, 3, device=DEVICE), torch.arange(n, device=DEVICE)
        torch.testing.assert_close(runner(x, lens), step(x, lens))
        assert torch.equal(runner.buffers[1][n:runner.bucket_for(n)],
                           torch.zeros_like(runner.buffers[1][n:runner.bucket_for(n)]))
    if DEVICE == "cpu":
        assert calls[::2] == [1, 4, 8, 4]  # each eager call ran its bucket's size
    with pytest.raises(ValueError, match="largest bucket"):
        runner(torch.randn(9, 3, device=DEVICE), torch.zeros(9, dtype=torch.int64, device=DEVICE))


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the kernels compile for real above")
def test_kernels_compile_for_hopper(tmp_path):
    """Compile every kernel variant for sm_90 without a GPU (catches what the interpreter
    accepts but the compiler rejects)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = os.environ.get("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    script = Path(__file__).parent / "gpu" / "compile_check.py"
    res = subprocess.run([sys.executable, str(script), "--arch", "90"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "kernel variants compiled" in res.stdout
