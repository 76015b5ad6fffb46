"""The fused C++ CPU kernels against their torch references."""
from __future__ import annotations

import pytest
import torch

from tpllm_kernels import cpu_ops
from tpllm_kernels import reference as ref
from tpllm_kernels.metadata import DecodeBatch, PrefillChunk
from tests.required import no_cpu_kernels, not_in_portable_build

if not cpu_ops.AVAILABLE:
    no_cpu_kernels(allow_module_level=True)
DTYPES = [torch.float32, torch.bfloat16]
# bf16 storage: the kernels compute in fp32 and round once, the reference rounds per op; allow a
# couple of bf16 steps (2^-8 relative) between them.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("hq, hkv", [(4, 4), (9, 3), (8, 1), (5, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention(hq, hkv, block_size, dtype):
    g = torch.Generator().manual_seed(hq * 100 + hkv + block_size)
    nb, d, b = 128, 40, 5
    kc = torch.randn(nb, block_size, hkv, d, generator=g)
    vc = torch.randn(nb, block_size, hkv, d, generator=g)
    lens = torch.tensor([1, 7, block_size, 3 * block_size + 1, 50])
    width = -(-int(lens.max()) // block_size)
    tables = torch.randperm(nb, generator=g)[:b * width].view(b, width)
    q = torch.randn(b, hq, d, generator=g)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    kv_index = None
    if hq % hkv:  # an uneven tensor-parallel split: explicit query -> KV head map
        kv_index = torch.tensor([min(h * hkv // hq, hkv - 1) for h in range(hq)])
    batch = DecodeBatch(tables, lens, int(lens.max()), block_size)
    want = ref.decode_attention(q, kc, vc, batch, 0.3, kv_index)
    got = cpu_ops.decode_attention(q, kc, vc, DecodeBatch(tables, lens, int(lens.max()),
                                                          block_size), 0.3, kv_index)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("splits", [0, 1, 3, 7])
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (8, 1, 64), (8, 2, 128), (5, 2, 64),
                                        (4, 2, 48)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_split_contexts(splits, hq, hkv, d, dtype):
    """Long contexts of a short batch split into several tasks (0: the kernel's own choice);
    splits that get no block (a short sequence beside a long one) must not disturb the merge.
    head_dim 64 and 128 take the vector path (query heads of a KV head in chunks of 4 and 2),
    48 the generic one; 5 over 2 is an uneven tensor-parallel head map."""
    g = torch.Generator().manual_seed(splits * 1000 + hq * 10 + d)
    nb, bs = 160, 16
    kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    lens = torch.tensor([1000, 20])
    width = -(-int(lens.max()) // bs)
    tables = torch.randperm(nb, generator=g)[:2 * width].view(2, width)
    q = (torch.randn(2, hq, d, generator=g) * 3).to(dtype)  # peaked softmax: merge weights matter
    kv_index = None
    if hq % hkv:
        kv_index = torch.tensor([min(h * hkv // hq, hkv - 1) for h in range(hq)])
    batch = DecodeBatch(tables, lens, int(lens.max()), bs)
    want = ref.decode_attention(q, kc, vc, batch, 0.125, kv_index)
    got = cpu_ops.decode_attention(q, kc, vc, batch, 0.125, kv_index, num_splits=splits)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (5, 2, 64), (4, 2, 48)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_verify_rows_read_the_context_once(hq, hkv, d, dtype):
    """Rows of one sequence verifying drafts (one block table, lengths one apart) attend as one
    task; each row's output is the same bits as computed alone, and matches the reference. The
    batch mixes runs of 1, 5 (its last rows crossing a block and a split boundary) and 9 rows
    (more than a run takes), and two sequences with equal tables but lengths not one apart."""
    g = torch.Generator().manual_seed(hq * 10 + d)
    nb, bs = 200, 16
    kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    perm = torch.randperm(nb, generator=g)
    width = 40
    seqs = [(perm[:width], [300]), (perm[width:2 * width], list(range(254, 259))),
            (perm[2 * width:3 * width], list(range(600, 609))),
            (perm[3 * width:4 * width], [100, 140])]
    tables = torch.stack([t for t, ls in seqs for _ in ls])
    lens = torch.tensor([n for _, ls in seqs for n in ls])
    q = (torch.randn(len(lens), hq, d, generator=g) * 3).to(dtype)
    kv_index = None
    if hq % hkv:
        kv_index = torch.tensor([min(h * hkv // hq, hkv - 1) for h in range(hq)])
    batch = DecodeBatch(tables, lens, int(lens.max()), bs)
    got = cpu_ops.decode_attention(q, kc, vc, batch, 0.125, kv_index)
    torch.testing.assert_close(got, ref.decode_attention(q, kc, vc, batch, 0.125, kv_index),
                               **TOL[dtype])
    for i in range(len(lens)):
        one = DecodeBatch(tables[i:i + 1], lens[i:i + 1], int(lens[i]), bs)
        alone = cpu_ops.decode_attention(q[i:i + 1], kc, vc, one, 0.125, kv_index)
        assert torch.equal(got[i:i + 1], alone), i


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_touch_pass_is_a_speed_switch(dtype, monkeypatch):
    """The in-order touch of each K/V block (csrc/attn_simd.h) only reads ahead: on or off, the
    same bits. It is on but for Intel CPUs (cpu_ops._attention_touch_pass_by_default), as set
    when the module loads. The portable build has no SIMD attention to touch for: always off."""
    import tpllm_kernels.cpu_ext as ext
    ext_mod = cpu_ops._ext
    has_pass = ext.isa_level() != "generic"
    assert ext_mod.attention_touch_pass() == (has_pass and
                                              cpu_ops._attention_touch_pass_by_default())
    for vendor, on in (("GenuineIntel", False), ("AuthenticAMD", True), ("", True)):
        monkeypatch.setattr(ext, "cpu_vendor", lambda v=vendor: v)
        assert cpu_ops._attention_touch_pass_by_default() == on
    g = torch.Generator().manual_seed(4)
    nb, bs, hq, hkv = 160, 16, 9, 3
    kc, vc = (torch.randn(nb, bs, hkv, 64, generator=g).to(dtype) for _ in range(2))
    lens = torch.tensor([700, 33, 1])
    tables = torch.randperm(nb, generator=g)[:3 * 44].view(3, 44)
    q = torch.randn(3, hq, 64, generator=g).to(dtype)
    batch = DecodeBatch(tables, lens, int(lens.max()), bs)
    default = ext_mod.attention_touch_pass()
    try:
        got = {}
        for on in (True, False):
            ext_mod.set_attention_touch_pass(on)
            assert ext_mod.attention_touch_pass() == (has_pass and on)
            got[on] = cpu_ops.decode_attention(q, kc, vc, batch, 0.125)
    finally:
        ext_mod.set_attention_touch_pass(default)
    assert torch.equal(got[True], got[False])
    torch.testing.assert_close(got[True], ref.decode_attention(q, kc, vc, batch, 0.125),
                               **TOL[dtype])


@pytest.mark.parametrize("hq, hkv, d", [(16, 8, 128), (4, 1, 256), (8, 4, 256), (6, 3, 48)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_touch_pass_is_a_speed_switch_for_any_head_dim(hq, hkv, d, dtype):
    """The same for other head dims (blocks of about 4 KB to 64 KB: the kernel touches only
    the small ones): on or off, the same bits, and the reference's result."""
    ext_mod = cpu_ops._ext
    g = torch.Generator().manual_seed(d + hq)
    nb, bs = 120, 16
    kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    lens = torch.tensor([600, 33, 1])
    tables = torch.randperm(nb, generator=g)[:3 * 38].view(3, 38)
    q = torch.randn(3, hq, d, generator=g).to(dtype)
    batch = DecodeBatch(tables, lens, int(lens.max()), bs)
    default = ext_mod.attention_touch_pass()
    try:
        got = {}
        for on in (True, False):
            ext_mod.set_attention_touch_pass(on)
            got[on] = cpu_ops.decode_attention(q, kc, vc, batch, d ** -0.5)
    finally:
        ext_mod.set_attention_touch_pass(default)
    assert torch.equal(got[True], got[False])
    torch.testing.assert_close(got[True], ref.decode_attention(q, kc, vc, batch, d ** -0.5),
                               **TOL[dtype])


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 32, cpu_ops.SMALL_M])
@pytest.mark.parametrize("k, n, bias", [(576, 960, False), (100, 9, True), (16, 4099, False),
                                        (64, 1024, False)])
def test_small_m_linear(m, k, n, bias):
    """The decode linear equals torch's (K not a multiple of 16 and N not of 4 included), and
    each row is the same bits alone or in any batch up to SMALL_M: no batch dependence."""
    g = torch.Generator().manual_seed(m * 7 + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = cpu_ops.linear(x, w, b)
    # another summation order than MKL's: rounding grows like sqrt(K) for unit-scale inputs
    torch.testing.assert_close(got, ref.linear(x, w, b), rtol=1e-5, atol=1e-5 * k ** 0.5)
    for i in {0, m - 1}:
        assert torch.equal(cpu_ops.linear(x[i:i + 1].contiguous(), w, b)[0], got[i])


def test_small_m_kernel_beyond_its_output_stage():
    """The C++ GEMV stages 16 weight rows' outputs for up to 64 inputs at a time; called directly
    with more inputs (cpu_ops sends those to a GEMM) it takes them 64 at a time, same bits."""
    g = torch.Generator().manual_seed(70)
    x, w = torch.randn(70, 48, generator=g), torch.randn(37, 48, generator=g)
    got = cpu_ops._ext.small_m_linear(x, w, None)
    torch.testing.assert_close(got, ref.linear(x, w), rtol=1e-5, atol=1e-5 * 48 ** 0.5)
    assert torch.equal(got[64:], cpu_ops._ext.small_m_linear(x[64:].contiguous(), w, None))


def test_linear_beyond_small_m_and_other_dtypes_use_torch(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_ops, "_ext", type("Spy", (), {
        "small_m_linear": staticmethod(lambda *a: calls.append("f32") or torch.zeros(0)),
        "small_m_linear_bf16": staticmethod(lambda *a: calls.append("bf16") or torch.zeros(0))}))
    monkeypatch.setattr(cpu_ops, "_BF16_GEMV", True)
    w = torch.randn(8, 16)
    cpu_ops.linear(torch.randn(cpu_ops.SMALL_M + 1, 16), w)
    cpu_ops.linear(torch.randn(cpu_ops.SMALL_M + 1, 16).bfloat16(), w.bfloat16())
    cpu_ops.linear(torch.randn(2, 16).half(), w.half())
    cpu_ops.linear(torch.randn(cpu_ops.BF16_SMALL_M + 1, 16).bfloat16(), w.bfloat16())
    cpu_ops.linear(torch.randn(16, 2).t(), w)  # not contiguous
    assert not calls
    cpu_ops.linear(torch.randn(cpu_ops.SMALL_M, 16), w)
    cpu_ops.linear(torch.randn(2, 16).bfloat16(), w.bfloat16())
    assert calls == ["f32", "bf16"]


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("k, n, bias", [(576, 960, False), (100, 9, True), (32, 4099, False)])
def test_small_m_linear_bf16(m, k, n, bias):
    """The bf16 decode linear is as close to a float32 product of the same bf16 values as
    torch's bf16 linear is (one rounding of an fp32 sum), and batch-invariant up to
    BF16_SMALL_M rows."""
    if not cpu_ops._BF16_GEMV:
        not_in_portable_build("bf16 GEMV")
    g = torch.Generator().manual_seed(m * 7 + k + n)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    got = cpu_ops.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    exact = ref.linear(x.float(), w.float(), None if b is None else b.float())
    torch_err = (ref.linear(x, w, b).float() - exact).abs().max()
    assert (got.float() - exact).abs().max() <= torch_err + 1e-3
    for i in {0, m - 1}:
        assert torch.equal(cpu_ops.linear(x[i:i + 1].contiguous(), w, b)[0], got[i])


@pytest.mark.parametrize("rows, inter", [(1, 1536), (5, 7), (300, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(rows, inter, dtype):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * inter, generator=g) * 8).to(dtype)  # both tails of exp
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # saturated sigmoid, exact zero
    want = ref.silu_mul(x)
    got = cpu_ops.silu_mul(x)
    assert got.shape == want.shape and got.dtype == dtype
    # bf16: both round silu's result and the product; fp32 exp differs by an ulp or two
    torch.testing.assert_close(got, want, **({} if dtype == torch.float32 else TOL[dtype]))


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x, res, w = (torch.randn(rows, 97, generator=g).to(dtype),
                 torch.randn(rows, 97, generator=g).to(dtype), torch.randn(97, generator=g).to(dtype))
    want_x, want_res = ref.add_rms_norm(x, res, w, 1e-5)
    got_x, got_res = cpu_ops.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)  # one rounded add: exact
    torch.testing.assert_close(got_x, want_x, **TOL[dtype])


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 97, generator=g).to(dtype), torch.randn(97, generator=g).to(dtype)
    x0 = x.clone()
    got = cpu_ops.rms_norm(x, w, 1e-5)
    assert torch.equal(x, x0)  # out of place
    torch.testing.assert_close(got, ref.rms_norm(x, w, 1e-5), **TOL[dtype])
    # the norm add_rms_norm computes after its add, bit for bit (the first layer's norm and the
    # later layers' are one computation)
    normed, _ = cpu_ops.add_rms_norm(x.clone(), torch.zeros_like(x), w, 1e-5)
    assert torch.equal(got, normed)


def test_rms_norm_falls_back_for_what_the_kernel_does_not_take():
    w = torch.randn(16)
    x = torch.randn(16, 3).t()  # not contiguous
    assert torch.equal(cpu_ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    xh, wh = torch.randn(3, 16, dtype=torch.float16), torch.randn(16, dtype=torch.float16)
    assert torch.equal(cpu_ops.rms_norm(xh, wh, 1e-5), ref.rms_norm(xh, wh, 1e-5))


def test_other_dtypes_fall_back_to_reference():
    x, res = (torch.randn(3, 16, dtype=torch.float16) for _ in range(2))
    w = torch.randn(16, dtype=torch.float16)
    want = ref.add_rms_norm(x, res, w, 1e-5)
    got = cpu_ops.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


@pytest.mark.parametrize("tokens, hq, hkv", [(1, 9, 3), (37, 4, 4), (5, 8, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_write_kv(tokens, hq, hkv, dtype):
    """Bit-exact in both dtypes: the kernel rounds where the reference's ops round."""
    g = torch.Generator().manual_seed(tokens)
    d, nb, bs = 32, 16, 4
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(dtype)
    ang = torch.rand(tokens, d // 2, generator=g) * 6
    cos, sin = (torch.cat([f(ang)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.randperm(nb * bs, generator=g)[:tokens]
    caches = [torch.zeros(nb, bs, hkv, d, dtype=dtype) for _ in range(4)]
    want = ref.rotary_write_kv(qkv.clone(), cos, sin, hq, hkv, caches[0], caches[1], slots)
    got = cpu_ops.rotary_write_kv(qkv.clone(), cos, sin, hq, hkv, caches[2], caches[3], slots)
    for w, o in zip(want, got):
        assert torch.equal(w, o)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


GEMM_LIBRARIES = [
    pytest.param("mkl", marks=pytest.mark.skipif(not cpu_ops._mkl_packing(),
                                                 reason="torch without MKL's packed GEMM")),
    pytest.param("onednn", marks=pytest.mark.skipif(not cpu_ops._onednn_available(),
                                                    reason="torch without oneDNN's linear")),
]


@pytest.mark.parametrize("library", GEMM_LIBRARIES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_serves_its_rows_only(library, bias, monkeypatch):
    """A packed weight serves the rows it was packed for (MKL's: exactly that count; oneDNN's:
    any count beyond the C++ GEMV's), equal to torch's GEMM up to summation order; every other
    row count takes the unpacked paths, bit for bit."""
    monkeypatch.setattr(cpu_ops, "GEMM_LIBRARY", library)
    g = torch.Generator().manual_seed(5)
    rows = cpu_ops.SMALL_M + 8
    w = torch.randn(300, 576, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    before = {m: cpu_ops.linear(torch.randn(m, 576, generator=torch.Generator().manual_seed(m)), w, b)
              for m in (1, cpu_ops.SMALL_M, rows - 8, rows + 8)}
    assert cpu_ops.pack_linear_weight(w, rows) == w.numel() * 4
    assert w.cpu_packed[0] == library
    assert cpu_ops.pack_linear_weight(w.bfloat16(), rows) == 0
    assert cpu_ops.pack_linear_weight(torch.randn(4, 4), cpu_ops.SMALL_M) == 0  # the C++ GEMV's
    served = [rows] if library == "mkl" else [rows, rows + 8, 1000]
    for m in served:
        x = torch.randn(m, 576, generator=g)
        assert cpu_ops._packed_copy(x, w) is not None
        torch.testing.assert_close(cpu_ops.linear(x, w, b), ref.linear(x, w, b), rtol=1e-5,
                                   atol=1e-5 * 576 ** 0.5)
    for m, want in before.items():
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        if m not in served:
            assert torch.equal(cpu_ops.linear(x, w, b), want)


@pytest.mark.parametrize("library", GEMM_LIBRARIES)
@pytest.mark.parametrize("rows", [cpu_ops.SMALL_M + 1, 300, 1024])
def test_gemm_rows_on_each_library(library, rows, monkeypatch):
    """Beyond the C++ GEMV's rows a float32 linear runs on GEMM_LIBRARY's GEMM: equal to
    torch's up to summation order, bias included; float32 only (bf16 keeps torch's path)."""
    monkeypatch.setattr(cpu_ops, "GEMM_LIBRARY", library)
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g), torch.randn(960, 576, generator=g)
    b = torch.randn(960, generator=g)
    calls = []
    onednn = cpu_ops._onednn_linear
    monkeypatch.setattr(cpu_ops, "_onednn_linear", lambda *a: calls.append(1) or onednn(*a))
    torch.testing.assert_close(cpu_ops.linear(x, w, b), ref.linear(x, w, b), rtol=1e-5,
                               atol=1e-5 * 576 ** 0.5)
    assert bool(calls) == (library == "onednn")
    cpu_ops.linear(x.bfloat16(), w.bfloat16(), b.bfloat16())
    assert len(calls) == (library == "onednn")


def test_gemm_library_setting(monkeypatch):
    """TPLLM_CPU_GEMM forces a library; a value it does not know is an error, not a guess."""
    monkeypatch.setenv(cpu_ops.GEMM_ENV, "mkl")
    assert cpu_ops._gemm_library() == "mkl"
    monkeypatch.setenv(cpu_ops.GEMM_ENV, "blis")
    with pytest.raises(ValueError, match="mkl or onednn"):
        cpu_ops._gemm_library()
    monkeypatch.delenv(cpu_ops.GEMM_ENV)
    from tpllm_kernels.cpu_ext import cpu_flags, cpu_vendor
    intel_avx512 = cpu_vendor() == "GenuineIntel" and "avx512f" in cpu_flags()
    want = "mkl" if intel_avx512 or not cpu_ops._onednn_available() else "onednn"
    assert cpu_ops._gemm_library() == want
    # by the CPU, not by this host: MKL only on an Intel CPU with AVX-512 (on AMD it ran at
    # about AVX2 speed whatever the flags)
    import tpllm_kernels.cpu_ext as ext
    for vendor, flags, library in (("GenuineIntel", {"avx512f", "avx2"}, "mkl"),
                                   ("GenuineIntel", {"avx2"}, "onednn"),
                                   ("AuthenticAMD", {"avx512f", "avx2"}, "onednn"),
                                   ("AuthenticAMD", {"avx2"}, "onednn")):
        monkeypatch.setattr(ext, "cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(ext, "cpu_flags", lambda f=flags: frozenset(f))
        assert cpu_ops._gemm_library() == (library if cpu_ops._onednn_available() else "mkl")


@pytest.mark.parametrize("library", GEMM_LIBRARIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_into_equals_linear(dtype, library, monkeypatch):
    """linear_into (a row-parallel partial sum computed into its all-reduce slot) gives linear's
    bits on every path: C++ GEMV rows, GEMM rows (each library), and the packed copy's rows."""
    monkeypatch.setattr(cpu_ops, "GEMM_LIBRARY", library)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(300, 576, generator=g).to(dtype)
    packed = cpu_ops.SMALL_M + 8
    w_packed = w.clone()
    cpu_ops.pack_linear_weight(w_packed, packed)
    for weight in (w, w_packed):
        for m in (1, cpu_ops.SMALL_M, cpu_ops.SMALL_M + 1, packed, 1024):
            x = torch.randn(m, 576, generator=g).to(dtype)
            slot = torch.full((m * 300 + 5,), float("nan"), dtype=dtype)  # a larger buffer's prefix
            out = slot[:m * 300].view(m, 300)
            got = cpu_ops.linear_into(x, weight, out)
            assert got.data_ptr() == slot.data_ptr() and torch.equal(got, cpu_ops.linear(x, weight))
            assert slot[m * 300:].isnan().all()


@pytest.mark.parametrize("tokens, prefix", [(1, 0), (7, 0), (37, 0), (300, 0), (13, 50), (64, 200)])
@pytest.mark.parametrize("hq, hkv, kv_index", [(9, 3, None), (4, 4, None), (5, 2, [0, 0, 0, 1, 1])])
@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_prefill_attention(tokens, prefix, hq, hkv, kv_index, block_size):
    """The C++ prefill attention equals torch's SDPA: causal over the chunk, the whole cached
    prefix visible, scattered blocks, any GQA map (uneven TP splits), block sizes not a multiple
    of the tiles, q a strided view of the fused qkv rows."""
    if not cpu_ops._fast_prefill(64):
        not_in_portable_build("prefill attention")
    g = torch.Generator().manual_seed(tokens * 31 + prefix + hq)
    ctx, d = prefix + tokens, 64
    nblk = -(-ctx // block_size)
    table = torch.randperm(nblk + 4, generator=g)[:nblk] + 1
    kc, vc = (torch.randn(nblk + 6, block_size, hkv, d, generator=g) for _ in range(2))
    q = torch.randn(tokens, hq + 2 * hkv, d, generator=g)[:, :hq]
    k = kc[table].reshape(-1, hkv, d)[prefix:ctx]
    v = vc[table].reshape(-1, hkv, d)[prefix:ctx]
    chunk = PrefillChunk(0, tokens, ctx, table)
    kvi = None if kv_index is None else torch.tensor(kv_index)
    got = cpu_ops.prefill_attention(q, k, v, kc, vc, chunk, 0.125, kvi)
    torch.testing.assert_close(got, ref.prefill_attention(q, k, v, kc, vc, chunk, 0.125, kvi),
                               rtol=1e-5, atol=1e-5)
