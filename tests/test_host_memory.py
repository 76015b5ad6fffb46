"""Weights and KV cache on CPU live in huge-page arenas (backend/model/host_memory.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.model import host_memory
from backend.model.config import ModelConfig
from backend.model.loader import load_model
from backend.parallel.context import SINGLE
from tests.tiny_models import make_tiny_checkpoint

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def _mapping_of(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping that holds address ptr."""
    entry: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a new mapping: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= ptr < hi
        elif inside:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    return entry


def test_arena_tensors_are_aligned_disjoint_and_zeroed():
    shapes = [(3, 5), (7,), (2, 2, 9)]
    out = host_memory.zeros(shapes, torch.float32)
    assert [tuple(t.shape) for t in out] == shapes
    assert all(t.data_ptr() % 64 == 0 and not t.any() for t in out)
    for t, v in zip(out, (1.0, 2.0, 3.0)):
        t.fill_(v)
    assert [t.unique().tolist() for t in out] == [[1.0], [2.0], [3.0]]  # no overlap
    arena = host_memory.HostArena(64)
    arena.take((16,), torch.float32)
    with pytest.raises(MemoryError, match="do not fit"):
        arena.take((1,), torch.float32)


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages")
def test_loaded_weights_sit_on_huge_pages(tmp_path):
    """The loaded model's weights all sit in one mapping, advised for and backed by huge
    pages."""
    d = make_tiny_checkpoint("llama", tmp_path / "m", vocab_size=16384, layers=2)
    cfg = ModelConfig.from_dir(d)
    model = load_model(d, cfg, SINGLE, torch.float32, "cpu")
    params = list(model.parameters())
    assert sum(p.numel() * 4 for p in params) > 4 * host_memory.HUGE_PAGE
    maps = {tuple(sorted(_mapping_of(p.data_ptr()).items())) for p in params}
    assert len(maps) == 1  # one arena
    entry = dict(next(iter(maps)))
    assert "hg" in entry.get("VmFlags", "").split()  # madvise(MADV_HUGEPAGE) took
    assert int(entry["AnonHugePages"].split()[0]) > 0


def test_available_bytes_reads_meminfo():
    avail = host_memory.available_bytes()
    if not Path("/proc/meminfo").exists():
        assert avail is None
    else:
        assert 0 < avail < 1 << 50


def test_block_copies_sit_on_huge_pages(tmp_path):
    """The weights' exact block copies (tpllm_kernels/cpu_blocks.py), which a decode step
    streams as it does the weights, sit together in one huge-page arena, not in the arena of the
    weights they copy nor on torch's 4 KiB pages, and still rebuild their weights."""
    from tpllm_kernels import cpu_ops
    from tests.required import no_cpu_kernels
    if cpu_ops.keep_block_copy is None:
        no_cpu_kernels("no block-copy GEMV in the C++ kernels here")
    d = make_tiny_checkpoint("llama", tmp_path / "m", vocab_size=16384, hidden_size=192,
                             layers=2)
    cfg = ModelConfig.from_dir(d)
    model = load_model(d, cfg, SINGLE, torch.float32, "cpu")
    assert model.ops is cpu_ops
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():  # every weight Q8_0-like: int8 codes, a scale of 2^-10
        if p.dim() == 2:
            q = torch.randint(-127, 128, p.shape, dtype=torch.float32, generator=g)
            q[:, ::32] = 127  # each block's largest |code|: its scale is exactly 2^-10
            p.data.copy_(q * 2.0 ** -10)
    assert model.keep_block_copies() > host_memory.HUGE_PAGE
    copies = [p.block_copy for p in model.parameters() if getattr(p, "block_copy", None)]
    assert len(copies) == 2 * 4 + 1  # 2 layers x (qkv, o, gate_up, down) + the head
    tensors = [t for c in copies for t in c[1:]]
    maps = {tuple(sorted(_mapping_of(t.data_ptr()).items())) for t in tensors}
    weights_map = _mapping_of(next(model.parameters()).data_ptr())
    assert len(maps) == 1 and dict(next(iter(maps))) != weights_map  # one arena of their own
    if _thp_mode() in ("always", "madvise"):
        entry = dict(next(iter(maps)))
        assert "hg" in entry.get("VmFlags", "").split()
        assert int(entry["AnonHugePages"].split()[0]) > 0
    for p in model.parameters():
        if getattr(p, "block_copy", None):
            kind, q, s = p.block_copy
            assert kind == "q8"
            rebuilt = q.float().view(q.shape[0], -1, 32) * s.view(q.shape[0], -1, 1)
            assert torch.equal(rebuilt.view(p.shape), p.data)
