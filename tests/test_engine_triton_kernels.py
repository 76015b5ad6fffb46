"""The model and the engine with the Triton kernels forced on, against the torch path.

Without a GPU the kernels run in Triton's interpreter on CPU (TPLLM_KERNELS=triton); on a CUDA
machine the model-level test runs compiled on the GPU (tests/gpu/check.sh), against the torch
path on CPU. Tiny random models keep the interpreter fast.
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_env import DEVICE, interpreter_missing  # noqa: E402  (sets TRITON_INTERPRET)

pytest.importorskip("triton")

from backend import LLM, SamplingParams  # noqa: E402
from backend.model.config import ModelConfig  # noqa: E402
from backend.model.loader import load_model  # noqa: E402
from backend.model.rotary import RotaryTables  # noqa: E402
from backend.parallel.context import ParallelContext  # noqa: E402
from tpllm_kernels import KERNELS_ENV, reference, triton_ops  # noqa: E402
from tpllm_kernels.metadata import AttentionMetadata, DecodeBatch, PrefillChunk  # noqa: E402
from tests.tiny_models import make_tiny_checkpoint  # noqa: E402

if interpreter_missing():
    pytest.skip("Triton was imported before TRITON_INTERPRET was set", allow_module_level=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    # GQA 3 (6 query heads, 2 KV heads), head_dim 16, two layers: seconds in the interpreter
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_llama_triton"),
                                vocab_size=256, layers=2)


@pytest.mark.skipif(DEVICE == "cuda", reason="the engine runs on CPU; on GPU see the model test")
def test_engine_greedy_tokens_match_torch_path(tiny_llama, monkeypatch):
    """Continuous batching (chunked prefill mixed with decodes) gives the same greedy tokens."""
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (3, 17, 9, 26)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(model=str(tiny_llama), num_kv_blocks=48, block_size=4, max_num_batched_tokens=16)
    monkeypatch.setenv(KERNELS_ENV, "torch")
    with LLM(**kw) as llm:
        assert llm.engine.runner.model.ops is reference
        expected = [o.token_ids for o in llm.generate(prompts, sp)]
    monkeypatch.setenv(KERNELS_ENV, "triton")
    with LLM(**kw) as llm:
        assert llm.engine.runner.model.ops is triton_ops
        got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == expected


def _logits_through_paged_cache(model, cfg: ModelConfig, device: str,
                                dtype: torch.dtype) -> torch.Tensor:
    """Two sequences through one paged cache: a step of two prefill chunks, a mixed step (a
    decode + a chunk over a cached prefix), then batched decodes. Returns every step's logits
    (float32, CPU), teacher-forced so both paths see the same tokens."""
    bs, nb = 4, 40
    hkv, d = model.layers[0].self_attn.num_kv, cfg.head_dim
    kv = [(torch.zeros(nb, bs, hkv, d, dtype=dtype, device=device),
           torch.zeros(nb, bs, hkv, d, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]
    rot = RotaryTables(cfg, 128, dtype)
    tokens = [torch.randint(3, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(s))
              for s in (1, 2)]
    tables = [list(range(1, nb - 1, 2)), list(range(2, nb, 2))]  # interleaved, never contiguous
    done = [0, 0]
    # per step: (sequence, tokens) pairs, decodes (one token) first as the engine lays them out
    steps = [[(0, 7), (1, 5)], [(1, 1), (0, 6)]] + [[(0, 1), (1, 1)]] * 4
    out = []
    for step in steps:
        ids, pos, slots, chunks, last = [], [], [], [], []
        for s, n in step:
            c0 = done[s]
            if n > 1:
                chunks.append(PrefillChunk(len(ids), n, c0 + n,
                                           torch.tensor(tables[s], device=device)))
            ids += tokens[s][c0:c0 + n].tolist()
            pos += list(range(c0, c0 + n))
            slots += [tables[s][p // bs] * bs + p % bs for p in range(c0, c0 + n)]
            last.append(len(ids) - 1)
            done[s] += n
        rope = {k: t.to(device) for k, t in rot.lookup_all(torch.tensor(pos)).items()}
        meta = AttentionMetadata(torch.tensor(slots, device=device), prefills=chunks, **rope)
        decodes = [s for s, n in step if n == 1]
        if decodes:
            lens = [done[s] for s in decodes]
            meta.decode = DecodeBatch(torch.tensor([tables[s] for s in decodes], device=device),
                                      torch.tensor(lens, device=device), max(lens), bs)
        logits = model(torch.tensor(ids, device=device), meta, kv,
                       torch.tensor(last, device=device))
        out.append(logits.float().cpu())
    return torch.cat(out)


def _load(model_dir, device: str, dtype: torch.dtype):
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device(device):  # parameters on `device`: the model picks its kernels by it
        return load_model(model_dir, cfg, ParallelContext(), dtype), cfg


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# the families whose parts the Triton path computes (q/k norms, GeGLU, sandwich norms, windows
# shorter than the sequences, soft caps, local rope, partial rotary)
FAMILIES = ("llama", "qwen3", "gemma2", "gemma3", "phi3")


@pytest.mark.parametrize("arch", FAMILIES)
def test_model_logits_triton_match_torch(arch, tiny_llama, tmp_path, monkeypatch):
    """float32: Triton on DEVICE equals the torch path on CPU up to summation order. bfloat16:
    both paths round differently at every layer, so each is measured against the float32
    torch logits and the Triton path may be at most modestly less accurate than torch's."""
    model_dir = tiny_llama if arch == "llama" else make_tiny_checkpoint(
        arch, tmp_path, vocab_size=256, layers=2)
    monkeypatch.setenv(KERNELS_ENV, "torch")
    ref = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, cfg = _load(model_dir, "cpu", dtype)
        assert model.ops is reference
        ref[dtype] = _logits_through_paged_cache(model, cfg, "cpu", dtype)
    monkeypatch.setenv(KERNELS_ENV, "auto" if DEVICE == "cuda" else "triton")
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, cfg = _load(model_dir, DEVICE, dtype)
        assert model.ops is triton_ops
        got[dtype] = _logits_through_paged_cache(model, cfg, DEVICE, dtype)
    exact = ref[torch.float32]
    err32 = _rel(got[torch.float32], exact)
    assert err32 <= 1e-5, f"float32 relative logits error {err32:.2e}"
    assert torch.equal(got[torch.float32].argmax(-1), exact.argmax(-1))
    err_torch, err_triton = _rel(ref[torch.bfloat16], exact), _rel(got[torch.bfloat16], exact)
    assert err_triton <= 1.5 * err_torch + 1e-3, \
        f"bf16 relative error vs float32: Triton {err_triton:.2e}, torch {err_torch:.2e}"


@pytest.mark.skipif(DEVICE == "cuda", reason="the engine runs on CPU; on GPU see the model test")
def test_lora_rows_on_the_triton_kernels_match_torch_path(tiny_llama, tmp_path, monkeypatch):
    """The GPU path's kernels (here in the interpreter) with LoRA rows of two adapters and none
    in one batch: the same greedy tokens as the torch path."""
    pytest.importorskip("peft")
    from tests.lora_adapters import make_adapter
    adapters = {"a": str(make_adapter(tiny_llama, tmp_path / "a", r=4, alpha=8, seed=1)),
                "b": str(make_adapter(tiny_llama, tmp_path / "b", r=2, alpha=4, seed=2,
                                      targets=["q_proj", "down_proj"]))}
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 13, 9)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, lora_name=name)
              for name in ("a", None, "b")]
    kw = dict(model=str(tiny_llama), num_kv_blocks=48, block_size=4, max_num_batched_tokens=16,
              enable_lora=True, max_lora_rank=8, lora_modules=adapters)
    monkeypatch.setenv(KERNELS_ENV, "torch")
    with LLM(**kw) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
        base = [o.token_ids for o in llm.generate(prompts, SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True))]
    assert expected != base  # the adapters change the output (else this proves nothing)
    monkeypatch.setenv(KERNELS_ENV, "triton")
    with LLM(**kw) as llm:
        assert llm.engine.runner.model.ops is triton_ops
        got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected
