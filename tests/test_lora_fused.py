"""LoRA decode steps on the fused C++ decode path (tpllm_kernels/csrc/decode_layer.cpp with
lora_delta.cpp): the stacked-adapter kernel against a torch reference, and decode steps with
adapter rows running fused (the stack, the halves) with the same bits as the modular path."""
from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from tests.required import no_cpu_kernels
from tests.lora_adapters import make_adapter
from tests.tiny_models import make_tiny_checkpoint

pytest.importorskip("peft")


def _cpu_ops():
    from tpllm_kernels import cpu_ops
    if not cpu_ops.AVAILABLE or not getattr(cpu_ops, "FUSED_LORA", False):
        no_cpu_kernels()
    return cpu_ops


def _stacked(gen, n: int, d_in: int, segments: list[tuple[int, int]],
             targets: list[tuple[int, list[int]]]):
    """Random stacked adapters in LoraSlot.stacked's layout: targets[i] = (r, targeted segment
    indices) of adapter i + 1 (r 0: none)."""
    r_max = max(r for r, _ in targets)
    big_r = max(r * len(s) for r, s in targets)
    out = segments[-1][1]
    a = torch.zeros(n, big_r, d_in)
    bt = torch.zeros(n, r_max, out)
    info = torch.zeros(n, 2 + 3 * len(segments), dtype=torch.int64)
    info[:, 2:] = torch.tensor([v for b, e in segments for v in (b, e, -1)])
    for i, (r, segs) in enumerate(targets):
        info[i, :2] = torch.tensor([r, r * len(segs)])
        for j, seg in enumerate(segs):
            begin, end = segments[seg]
            a[i, j * r:(j + 1) * r] = torch.randn(r, d_in, generator=gen)
            bt[i, :r, begin:end] = torch.randn(r, end - begin, generator=gen)
            info[i, 4 + 3 * seg] = j * r
    return a, bt, info


def _reference(x, y, a, bt, info, ids):
    """y + each row's delta in float64: B_seg @ (A_part @ x) per targeted segment."""
    want = y.double().clone()
    for m, aid in enumerate(ids.tolist()):
        if aid == 0 or info[aid - 1, 0] == 0:
            continue
        r = int(info[aid - 1, 0])
        for seg in range((info.shape[1] - 2) // 3):
            begin, end, off = info[aid - 1, 2 + 3 * seg:5 + 3 * seg].tolist()
            if off < 0:
                continue
            t = a[aid - 1, off:off + r].double() @ x[m].double()
            want[m, begin:end] += bt[aid - 1, :r, begin:end].double().t() @ t
    return want


@pytest.mark.parametrize("d_in", [96, 577])
def test_lora_delta_kernel(d_in):
    """Every row's delta from its own adapter (merged segments with their own shrunk values,
    adapters that skip a linear or a segment, rows of none left as they are, to the bit); a
    row's result the same bits whatever else is in the batch and wherever its group's rows lie."""
    ops = _cpu_ops()
    gen = torch.Generator().manual_seed(0)
    segments = [(0, 64), (64, 83), (83, 102)]  # q/k/v-like parts, tails beyond 16 lanes
    a, bt, info = _stacked(gen, 4, d_in, segments,
                           [(8, [0, 1, 2]), (4, [0, 2]), (0, []), (6, [1])])
    out = segments[-1][1]
    ids = torch.tensor([1, 1, 2, 0, 3, 4, 4, 2, 1], dtype=torch.int64)
    x = torch.randn(len(ids), d_in, generator=gen)
    y0 = torch.randn(len(ids), out, generator=gen)
    y = y0.clone()
    assert ops.lora_delta_(x, y, a, bt, info, ids)
    torch.testing.assert_close(y.double(), _reference(x, y0, a, bt, info, ids), rtol=1e-5,
                               atol=1e-4)
    assert torch.equal(y[3], y0[3]) and torch.equal(y[4], y0[4])  # no adapter; one of r 0
    assert torch.equal(y[5:7, :64], y0[5:7, :64])  # adapter 4 targets only the second part
    for m in range(len(ids)):  # each row alone: the same bits
        alone = y0[m:m + 1].clone()
        ops.lora_delta_(x[m:m + 1].contiguous(), alone, a, bt, info, ids[m:m + 1].clone())
        assert torch.equal(alone[0], y[m]), m
    # rows sorted by adapter (contiguous groups, read in place): the same bits per row
    order = torch.argsort(ids, stable=True)
    ys = y0[order].contiguous()
    ops.lora_delta_(x[order].contiguous(), ys, a, bt, info, ids[order].contiguous())
    assert torch.equal(ys, y[order])


def _run(llm, prompts, params, model, stack: bool, fused: bool, calls: list[str]):
    model.fused_stack, model.fused_decode = stack, fused
    calls.clear()
    before = model.fused_lora_steps
    try:
        outs = llm.generate(prompts, params) + llm.generate(prompts[:1], params[:1])
    finally:
        model.fused_stack = model.fused_decode = True
    return ([(o.token_ids, o.cumulative_logprob) for o in outs], set(calls),
            model.fused_lora_steps - before)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fused_lora_decode_matches_the_modular_path(arch, tmp_path, default_model_dir,
                                                    monkeypatch):
    """Decode steps with adapter rows (two adapters of different ranks and targets, and rows of
    none) run all layers in one C++ call, or each layer as two calls, and give the same tokens
    and log-probabilities, to the bit, as the modular path; the fused runs are counted as fused
    LoRA steps (a silent fall-back to the modular path fails here)."""
    cpu_ops = _cpu_ops()
    model_dir = make_tiny_checkpoint(arch, tmp_path / "model", bias=True,
                                     tokenizer_dir=default_model_dir)
    adapters = {"all": make_adapter(model_dir, tmp_path / "all", r=8, alpha=16, seed=1),
                "qv_down": make_adapter(model_dir, tmp_path / "qv", r=4, alpha=8, seed=2,
                                        rslora=True, targets=["q_proj", "v_proj", "down_proj"])}
    prompts = ["The quick brown fox", "Once upon a time there", "1 2 3", "def f(x):"]
    names = ["all", None, "qv_down", "all"]
    params = [SamplingParams(temperature=0.8, seed=3 + i, max_tokens=8, ignore_eos=True,
                             logprobs=True, lora_name=name) for i, name in enumerate(names)]
    with LLM(model=str(model_dir), num_kv_blocks=256, block_size=8, enable_lora=True,
             max_lora_rank=8, lora_modules={k: str(v) for k, v in adapters.items()}) as llm:
        model = llm.engine.runner.model
        calls: list[str] = []
        for name in ("decode_stack", "decode_attention_half"):
            fn = getattr(cpu_ops, name)
            monkeypatch.setattr(cpu_ops, name,
                                lambda *a, _n=name, _f=fn: calls.append(_n) or _f(*a))
        stack, used, fused_steps = _run(llm, prompts, params, model, True, True, calls)
        assert used == {"decode_stack"} and fused_steps > 0
        halves, used, fused_steps = _run(llm, prompts, params, model, False, True, calls)
        assert used == {"decode_attention_half"} and fused_steps > 0
        modular, used, fused_steps = _run(llm, prompts, params, model, False, False, calls)
        assert not used and fused_steps == 0
        assert stack == halves == modular
        # and the adapters changed the tokens (else this test proves little)
        base = llm.generate(prompts, [SamplingParams(temperature=0.8, seed=3 + i, max_tokens=8,
                                                     ignore_eos=True) for i in range(4)])
        assert [o.token_ids for o in base][0] != stack[0][0]
        assert sum(llm.stats["cold_path"].values()) == 0


def test_tensor_parallel_lora_decode_runs_fused(tmp_path, default_model_dir):
    """TP2: decode steps with adapter rows run on the fused kernels at each rank (rank 0's count;
    the workers run the same model code), the greedy tokens those of one rank."""
    _cpu_ops()
    model_dir = make_tiny_checkpoint("llama", tmp_path / "model", bias=True,
                                     tokenizer_dir=default_model_dir)
    adapter = make_adapter(model_dir, tmp_path / "a", r=8, seed=5)
    prompts = ["The quick brown fox", "Once upon a time there", "1 2 3"]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora_name=name)
              for name in ("a", None, "a")]
    kw = dict(model=str(model_dir), num_kv_blocks=64, block_size=8, max_num_seqs=8,
              warmup=False, enable_lora=True, max_lora_rank=8, lora_modules={"a": str(adapter)})
    with LLM(**kw) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(tensor_parallel_size=2, **kw) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert llm.engine.runner.model.fused_lora_steps > 0
