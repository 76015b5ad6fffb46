"""Our forward pass against transformers: logits on tiny random checkpoints, greedy tokens on
the real default model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.kv_manager import KVCacheManager
from backend.engine.model_runner import ModelRunner
from backend.engine.sequence import Sequence
from backend.engine.step_inputs import build_step_inputs
from backend.model.config import ModelConfig
from backend.model.errors import ModelLoadError
from backend.model.loader import load_model
from backend.parallel.context import ParallelContext
from tests.tiny_models import ARCHS, hf_model, make_tiny_checkpoint


def _our_logits(model_dir, token_ids: list[int], chunks: list[int],
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits at every position, computed chunk by chunk through the paged KV cache."""
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, cfg, ParallelContext(), dtype)
    runner = ModelRunner(model, num_blocks=32, block_size=4, max_model_len=256, dtype=dtype)
    kv = KVCacheManager(32, 4)
    seq = Sequence("r", list(token_ids), len(token_ids), SamplingParams(), 0)
    out = []
    for n in chunks:
        assert kv.allocate(seq, seq.num_computed_tokens + n)
        inputs, *_ = build_step_inputs([(seq, n)], block_size=4)
        inputs.logits_indices = np.arange(n)
        out.append(runner.forward(inputs))
        seq.num_computed_tokens += n
    return torch.cat(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_logits_match_transformers(arch, tmp_path):
    make_tiny_checkpoint(arch, tmp_path, shards=2 if arch == "llama" else 1)
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (30,)).tolist()
    # prefill in uneven chunks (a block boundary inside a chunk, a chunk over a cached prefix),
    # then 8 single-token decode steps
    ours = _our_logits(tmp_path, ids, [7, 10, 5] + [1] * 8)
    with torch.no_grad():
        ref = hf_model(tmp_path)(torch.tensor([ids])).logits[0]
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, f"{arch}: relative logits error {rel:.2e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_bfloat16_as_accurate_as_transformers(arch, tmp_path):
    """bfloat16 (the AMX path on CPU): our error against the float32 reference is no worse than
    transformers' own bfloat16 error (our fused kernels round less often, so usually smaller)."""
    make_tiny_checkpoint(arch, tmp_path)
    torch.manual_seed(2)
    ids = torch.randint(0, 512, (30,)).tolist()
    ours = _our_logits(tmp_path, ids, [7, 10, 5] + [1] * 8, torch.bfloat16)
    with torch.no_grad():
        ref = hf_model(tmp_path)(torch.tensor([ids])).logits[0]
        hf_bf16 = hf_model(tmp_path, torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    scale = ref.abs().max()
    ours_err = ((ours - ref).abs().max() / scale).item()
    hf_err = ((hf_bf16 - ref).abs().max() / scale).item()
    assert ours.dtype == torch.float32
    assert ours_err <= max(1.5 * hf_err, 1e-2), f"{arch}: ours {ours_err:.2e} vs HF bf16 {hf_err:.2e}"


def test_tiny_batched_decode_matches_single(tmp_path):
    """Mixed batch (decodes + prefill chunks, different lengths) equals one-at-a-time greedy."""
    make_tiny_checkpoint("qwen2", tmp_path)
    llm = LLM(model=str(tmp_path), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (3, 17, 9, 40, 1)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [llm.generate(p, sp)[0].token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompts, sp)]
    assert together == alone


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
    "Translate to French: I like apples.",
    "The quick brown fox",
    "Explain photosynthesis in one sentence.",
    "1, 2, 3, 4, 5,",
    "Water boils at a temperature of",
]


def _hf_greedy(hf, tokenizer, prompt: str, n: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def hf_output_logprob(hf, prompt_ids: list[int], output_ids: list[int]) -> float:
    """Sum over the output tokens of log_softmax(transformers' logits)[token]: the reference for
    a request's cumulative_logprob (raw: no temperature, no penalties)."""
    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    with torch.no_grad():
        logp = hf(ids).logits[0].float().log_softmax(-1)
    start = len(prompt_ids) - 1  # the logits at position i predict token i + 1
    return sum(float(logp[start + i, t]) for i, t in enumerate(output_ids))


@pytest.fixture(scope="module")
def hf_reference(smollm, hf_smollm):
    chat = smollm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True)
    prompts = SMOL_PROMPTS + [chat]
    return prompts, [_hf_greedy(hf_smollm, smollm.tokenizer, p, 32) for p in prompts]


def test_smollm_greedy_one_at_a_time(smollm, hf_reference):
    prompts, expected = hf_reference
    sp = SamplingParams(temperature=0, max_tokens=32)
    for prompt, want in zip(prompts, expected):
        assert smollm.generate(prompt, sp)[0].token_ids == want, prompt


def test_smollm_greedy_batched(smollm, hf_reference):
    prompts, expected = hf_reference
    outs = smollm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    assert [o.token_ids for o in outs] == expected
    for o in outs:
        assert o.text == smollm.tokenizer.decode(o.token_ids, skip_special_tokens=True)


def test_missing_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(model=str(tmp_path / "nope"))
    make_tiny_checkpoint("llama", tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(tmp_path, ModelConfig.from_dir(tmp_path), ParallelContext(), torch.float32)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match="unsupported model_type"):
        ModelConfig.from_dir(tmp_path)
