"""Buckets known at load, every one warmed before ready, nothing new afterwards."""
from __future__ import annotations

import random

import pytest

from backend import LLM, SamplingParams
from backend.engine.buckets import BucketPlan
from backend.engine.kv_manager import KVCacheManager
from backend.engine.scheduler import Scheduler
from backend.engine.sequence import Sequence
from tests.required import no_cpu_kernels
from tests.tiny_models import make_tiny_checkpoint


@pytest.mark.parametrize("seqs, tokens", [(64, 2048), (8, 64), (5, 100), (256, 8192), (1, 16)])
def test_every_size_maps_to_a_bucket(seqs, tokens):
    plan = BucketPlan.build(seqs, tokens)
    for rows in range(1, min(seqs, tokens) + 1):
        b = plan.decode_bucket(rows)
        assert b in plan.decode_sizes and b >= rows
        assert all(s < rows for s in plan.decode_sizes if s < b)  # the smallest that fits
    for t in range(1, tokens + 1):
        b = plan.token_bucket(t)
        assert b in plan.token_sizes and b >= t and b <= tokens
    assert plan.token_sizes[-1] == tokens and plan.num_buckets < 64


def test_scheduler_trims_the_last_chunk_to_a_bucket():
    plan = BucketPlan.build(8, 256)
    kv = KVCacheManager(256, 4)
    sched = Scheduler(kv, 8, 256, plan)
    for i, n in enumerate((3, 100, 90)):
        sched.add(Sequence(str(i), list(range(n)), n, SamplingParams(), i))
    out = sched.schedule()
    total = out.num_tokens
    assert total in plan.token_sizes and total == 192  # 193 tokens wanted: trimmed by one
    assert [n for _, n in out.scheduled] == [3, 100, 89]


def test_scheduler_pads_a_last_chunk_it_would_cut_more_of():
    """255 tokens: 1 token of padding to the 256 bucket instead of 63 cut to 192 and a step of
    their own before the prompt's first token."""
    plan = BucketPlan.build(8, 512)
    sched = Scheduler(KVCacheManager(256, 4), 8, 512, plan)
    sched.add(Sequence("a", list(range(255)), 255, SamplingParams(), 0))
    out = sched.schedule()
    assert [n for _, n in out.scheduled] == [255] and plan.token_bucket(out.num_tokens) == 256
    # a prompt the budget cuts (more of it runs next step anyway) is not padded
    sched = Scheduler(KVCacheManager(256, 4), 8, 512, plan)
    sched.add(Sequence("b", list(range(600)), 600, SamplingParams(), 0))
    assert [n for _, n in sched.schedule().scheduled] == [512]


def test_scheduler_pads_a_short_last_chunk_rather_than_run_a_step_for_its_rest():
    """36 tokens: 12 of padding to the 48 bucket cost less than a step of its own for the 4 a
    trim to 32 would leave (an 8-token step costs ~16 tokens of compute on a CPU); without a
    step overhead (CUDA's default) the old rule trims (pads only when it would cut more)."""
    plan = BucketPlan.build(8, 512)
    for overhead, expected in ((16, [36]), (0, [32])):
        sched = Scheduler(KVCacheManager(256, 4), 8, 512, plan, step_overhead_tokens=overhead)
        sched.add(Sequence("a", list(range(36)), 36, SamplingParams(), 0))
        assert [n for _, n in sched.schedule().scheduled] == expected
    # more padding than the overhead: 70 tokens trim to 64 (pad to 96 would waste 26)
    sched = Scheduler(KVCacheManager(256, 4), 8, 512, plan, step_overhead_tokens=16)
    sched.add(Sequence("b", list(range(70)), 70, SamplingParams(), 0))
    assert [n for _, n in sched.schedule().scheduled] == [64]


def _varied_workload(llm: LLM, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(4):
        prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 120))]
                   for _ in range(rng.randrange(1, 12))]
        params = [SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True,
                                 temperature=rng.choice([0.0, 0.7]), top_p=rng.choice([1.0, 0.9]))
                  for _ in prompts]
        outs = llm.generate(prompts, params)
        assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs, params))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """More layers than warmup runs its prompt buckets through (WARM_LAYERS): what it skips
    must leave nothing cold."""
    from backend.engine.warmup import WARM_LAYERS
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_warm"),
                                layers=WARM_LAYERS + 2)


def _prompt_layer_calls(monkeypatch) -> list[int]:
    """The id of each decoder layer a step with a prompt chunk runs, in order, from now on."""
    from backend.model.llama import DecoderLayer
    calls: list[int] = []
    real = DecoderLayer.__call__

    def spy(self, x, residual, meta, kv_cache):
        if meta.prefills:
            calls.append(id(self))
        return real(self, x, residual, meta, kv_cache)

    monkeypatch.setattr(DecoderLayer, "__call__", spy)
    return calls


def test_prompt_buckets_warm_through_the_first_layers(tiny, monkeypatch):
    """Each bucket with a prompt chunk runs the first WARM_LAYERS layers in warmup (then the
    norm, head and sampler), every later layer none; real prompt steps run all of them, and
    meet no shape warmup did not run."""
    from backend.engine.warmup import WARM_LAYERS

    prompt_calls = _prompt_layer_calls(monkeypatch)
    llm = LLM(model=str(tiny), num_kv_blocks=128, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=96)
    layers = [id(layer) for layer in llm.engine.runner.model.layers]
    buckets = len(llm.engine.plan.token_sizes)
    assert [prompt_calls.count(i) for i in layers] == (
        [buckets] * WARM_LAYERS + [0] * (len(layers) - WARM_LAYERS))
    prompt_calls.clear()
    _varied_workload(llm, seed=3)
    counts = [prompt_calls.count(i) for i in layers]
    assert counts[0] > 0 and len(set(counts)) == 1, counts
    assert llm.engine.cold_path.total == 0, llm.engine.cold_path.snapshot()


def test_prompt_buckets_warm_each_layer_kind(tmp_path, monkeypatch):
    """A family with layer kinds (Gemma 3: windowed layers, then a global one) runs its prompt
    buckets through the first layer of each kind; real prompts then meet nothing cold."""
    import transformers as tf
    from backend.engine.warmup import warm_layers

    assert warm_layers((0,) * 6) == warm_layers((8, 0, 8, 0)) == 2
    assert warm_layers((8, 8, 8, 8, 8, 0, 8)) == 6
    assert warm_layers((0,) * 6, (3, 5)) == 4  # the first MoE layer is the fourth
    assert warm_layers((0,) * 6, tuple(range(6))) == 2
    model = make_tiny_checkpoint("gemma3", tmp_path, layers=5)
    cfg = tf.AutoConfig.from_pretrained(model)  # one global layer, last: the worst case
    cfg.layer_types = ["sliding_attention"] * 4 + ["full_attention"]
    cfg.save_pretrained(model)
    prompt_calls = _prompt_layer_calls(monkeypatch)
    llm = LLM(model=str(model), num_kv_blocks=128, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=96)
    layers = [id(layer) for layer in llm.engine.runner.model.layers]
    assert [prompt_calls.count(i) > 0 for i in layers] == [True] * 5
    _varied_workload(llm, seed=4)
    assert llm.engine.cold_path.total == 0, llm.engine.cold_path.snapshot()


def test_prompt_buckets_with_adapter_rows_warm_through_every_layer(tiny, tmp_path, monkeypatch):
    """An adapter may target any layers: warmup's steps with adapter rows run them all, and
    then a prompt with an adapter on only the last layer meets nothing cold."""
    from peft import LoraConfig, get_peft_model

    from backend.engine.warmup import WARM_LAYERS
    from tests.tiny_models import hf_model

    last = WARM_LAYERS + 1  # the tiny model's last layer, which plain prompt buckets skip
    peft = get_peft_model(hf_model(tiny), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], layers_to_transform=[last]))
    peft.save_pretrained(tmp_path / "late", safe_serialization=True)
    prompt_calls = _prompt_layer_calls(monkeypatch)
    llm = LLM(model=str(tiny), num_kv_blocks=128, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=96, enable_lora=True, max_lora_rank=4,
              lora_modules={"late": str(tmp_path / "late")})
    model = llm.engine.runner.model
    assert model.layers[last].self_attn.qkv_proj.lora is not None
    assert model.layers[0].self_attn.qkv_proj.lora is None
    buckets = len(llm.engine.plan.token_sizes)
    assert [prompt_calls.count(id(layer)) for layer in model.layers] == (
        [2 * buckets] * WARM_LAYERS + [buckets] * (len(model.layers) - WARM_LAYERS))
    outs = llm.generate([list(range(3, 90)), list(range(5, 40))],
                        [SamplingParams(max_tokens=4, lora_name="late"),
                         SamplingParams(max_tokens=4)])
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert llm.engine.cold_path.total == 0, llm.engine.cold_path.snapshot()


def test_no_cold_path_after_ready(tiny):
    llm = LLM(model=str(tiny), num_kv_blocks=128, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=96)
    plan = llm.engine.plan
    assert len(llm.engine.warm_shapes) == plan.num_buckets
    assert llm.stats["warmup_seconds"] > 0
    _varied_workload(llm, seed=1)
    assert llm.engine.cold_path.total == 0, llm.engine.cold_path.snapshot()
    assert llm.stats["cold_path"] == {}


def test_counter_sees_cold_shapes_without_warmup(tiny):
    llm = LLM(model=str(tiny), num_kv_blocks=128, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=96, warmup=False)
    _varied_workload(llm, seed=1)
    assert llm.engine.cold_path.snapshot().get("new_shape", 0) > 0


def test_async_engine_warms_up_on_its_own_thread(tiny, monkeypatch):
    """The thread that serves is the thread that was warmed (per-thread OpenMP/oneDNN state),
    and nothing counts as cold afterwards when requests arrive from other threads."""
    import threading

    from backend.engine import llm_engine
    from backend.engine.async_engine import AsyncEngine
    from backend.engine.config import EngineConfig

    warmed_on = []
    real = llm_engine.run_warmup

    def spy(engine):
        warmed_on.append(threading.get_ident())
        return real(engine)

    monkeypatch.setattr(llm_engine, "run_warmup", spy)
    engine = llm_engine.LLMEngine(EngineConfig(model=str(tiny), num_kv_blocks=128, block_size=8,
                                               max_num_seqs=8, max_num_batched_tokens=96),
                                  defer_warmup=True)
    assert not warmed_on and not engine.cold_path.ready
    ae = AsyncEngine(engine, warm_up=True)
    ae.wait_ready(timeout=120)
    assert warmed_on == [ae._thread.ident] and engine.cold_path.ready
    streams = [ae.add_request(f"r{n}", list(range(3, 3 + n)),
                              SamplingParams(max_tokens=5, ignore_eos=True)) for n in (1, 40, 90)]
    finals = [list(s)[-1] for s in streams]
    assert [(o.finish_reason, o.num_output_tokens) for o in finals] == [("length", 5)] * 3
    assert engine.cold_path.total == 0, engine.cold_path.snapshot()
    ae.shutdown()


def test_async_engine_reports_a_failed_warmup(tiny, monkeypatch):
    from backend.engine import llm_engine
    from backend.engine.async_engine import AsyncEngine
    from backend.engine.config import EngineConfig

    def boom(engine):
        raise MemoryError("no room for bucket 96")

    monkeypatch.setattr(llm_engine, "run_warmup", boom)
    engine = llm_engine.LLMEngine(EngineConfig(model=str(tiny), num_kv_blocks=16, block_size=8,
                                               max_num_seqs=8, max_num_batched_tokens=96),
                                  defer_warmup=True)
    ae = AsyncEngine(engine, warm_up=True)
    with pytest.raises(RuntimeError, match="warmup failed: no room for bucket 96"):
        ae.wait_ready(timeout=60)


def test_library_gemm_shapes_after_ready_were_warmed(tiny, monkeypatch):
    """oneDNN builds a kernel per (rows, K, N) the first time it meets one
    (tpllm_kernels/cpu_ops.py): every GEMM shape a workload sends it after READY is one warmup
    already ran."""
    from tpllm_kernels import cpu_ops
    if not cpu_ops.AVAILABLE:
        no_cpu_kernels()
    if not cpu_ops._onednn_available():
        pytest.skip("torch without oneDNN's linear")
    monkeypatch.setattr(cpu_ops, "GEMM_LIBRARY", "onednn")
    shapes: list[tuple[int, ...]] = []
    onednn = cpu_ops._onednn_linear
    monkeypatch.setattr(cpu_ops, "_onednn_linear", lambda x, w, b: shapes.append(
        (x.shape[0], *w.shape)) or onednn(x, w, b))
    llm = LLM(model=str(tiny), num_kv_blocks=256, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=256)
    warmed = set(shapes)
    assert any(rows > cpu_ops.SMALL_M for rows, _, _ in warmed)
    shapes.clear()
    _varied_workload(llm, seed=2)
    assert shapes and set(shapes) <= warmed, sorted(set(shapes) - warmed)
