"""The GPU path's logic that runs without a GPU: device settings, the static-buffer decode path
(what CUDA graphs replay) run eagerly on CPU, the GPU communicator's message split and gather,
and the replica's device from its instance kind. The GPU itself: tests/gpu/check.sh."""
from __future__ import annotations

import datetime
import multiprocessing as mp
import socket

import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.config import EngineConfig
from backend.engine.device_inputs import DeviceInputs
from backend.parallel.comm_select import on_gpu, rank_device
from backend.parallel.gpu_comm import assemble_gathered, pad_columns, use_one_shot
from backend.triton.model_config import parse_parameters
from backend.triton.placement import Placement, PlacementError, engine_device
from tpllm_kernels import KERNELS_ENV
from tests.tiny_models import make_tiny_checkpoint
from tests.triton_env import interpreter_missing  # Triton interpreted on CPU, set before it loads

NO_CUDA = not torch.cuda.is_available()


def test_device_setting_validation():
    assert EngineConfig(device="cpu").resolved_device() == torch.device("cpu")
    for bad in ("tpu", "cuda:x", "gpu0"):
        with pytest.raises(ValueError, match="^device: must be"):
            EngineConfig(device=bad).validate()
    if NO_CUDA:
        assert EngineConfig().resolved_device() == torch.device("cpu")  # auto
        for d in ("cuda", "cuda:1"):
            with pytest.raises(ValueError, match=f"^device: {d} requested but torch sees no CUDA"):
                EngineConfig(device=d).validate()
    else:
        n = torch.cuda.device_count()
        with pytest.raises(ValueError, match="needs CUDA devices"):
            EngineConfig(device="cuda", tensor_parallel_size=n + 1).validate()


def test_cpu_step_inputs_are_not_copied():
    a, b = np.arange(6, dtype=np.int64), np.ones((2, 3), dtype=np.int64)
    ta, tb = DeviceInputs("cpu").to_device(a, b)
    assert tb.shape == (2, 3)
    assert np.shares_memory(ta.numpy(), a) and np.shares_memory(tb.numpy(), b)


def test_step_inputs_packed_into_one_transfer():
    """The CUDA path's packing (one host buffer, one copy, split views), forced on CPU; the
    small capacity makes the buffer grow on the second call."""
    staging = DeviceInputs("cpu", capacity=8, pack=True)
    for n in (3, 11):
        arrays = [np.arange(n, dtype=np.int64), np.zeros(0, dtype=np.int64),
                  np.arange(2 * n, dtype=np.int64).reshape(n, 2) + 100, np.array([7])]
        out = staging.to_device(*arrays)
        assert [t.shape for t in out] == [a.shape for a in arrays]
        assert all(np.array_equal(t.numpy(), a) for t, a in zip(out, arrays))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_graphs"), vocab_size=256)


# auto: the C++ decode kernel up to batch 16, torch's masked SDPA above; torch: masked SDPA at
# every size; triton: the GPU kernels (interpreted on CPU), as CUDA graphs run them
@pytest.mark.parametrize("kernels", ["auto", "torch", "triton"])
def test_static_decode_path_matches_normal_path(tiny_llama, kernels, monkeypatch):
    """Decode steps through the CUDA-graph buffers (run eagerly here: use_graphs=False), with
    block tables widened to max_model_len and logits for every bucket row, and every step's
    inputs packed into one transfer, give the normal path's greedy tokens, from batch 1 up to
    the bucket of all prompts (24: > 16)."""
    if kernels == "triton":
        pytest.importorskip("triton")
        if interpreter_missing():
            pytest.skip("Triton was imported before TRITON_INTERPRET was set")
    monkeypatch.setenv(KERNELS_ENV, kernels)
    gen = torch.Generator().manual_seed(3)
    num = 10 if kernels == "triton" else 20  # the interpreter is slow
    prompts = [torch.randint(3, 256, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 40, (num,), generator=gen)]
    lengths = [3 + i % 5 if kernels == "triton" else 4 + i % 9 for i in range(num)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    # scheduled as on CUDA (no admission groups: step_overhead_tokens 0 there), so that every
    # sequence decodes at once at some step
    kw = dict(model=str(tiny_llama), num_kv_blocks=256, block_size=4, max_num_seqs=24,
              max_num_batched_tokens=256, max_model_len=96, warmup=False, step_overhead_tokens=0)
    with LLM(**kw) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
        alone = llm.generate(prompts[0], params[0])[0].token_ids
    with LLM(**kw) as llm:
        runner = llm.engine.runner
        if runner.device.type == "cpu":  # stage every step's inputs as on CUDA (one transfer)
            runner.inputs = DeviceInputs("cpu", capacity=16, pack=True)
        runner.enable_decode_graphs(llm.engine.plan.decode_sizes, use_graphs=False)
        graphs = runner.decode_graphs
        assert graphs.width == 24  # 96 tokens / 4 per block
        seen = []
        run = graphs.run
        graphs.run = lambda inputs: seen.append(inputs.num_tokens) or run(inputs)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.generate(prompts[0], params[0])[0].token_ids == alone
    assert got == expected
    top = llm.engine.plan.decode_bucket(num)  # every sequence decoding at once
    assert {1, top} <= set(seen) and len(set(seen)) >= 4, sorted(set(seen))


def test_capture_after_ready_is_a_cold_path(tiny_llama):
    with LLM(model=str(tiny_llama), num_kv_blocks=16, max_num_seqs=2,
             max_num_batched_tokens=16, device="cpu") as llm:
        eng = llm.engine
        assert not eng.uses_cuda_graphs and eng.runner.decode_graphs is None  # CPU: no graphs
        eng.cold_path.ready = False
        eng._captured(8)  # what GraphRunner reports during warmup: free
        eng.cold_path.ready = True
        assert eng.cold_path.total == 0
        eng._captured(8)
        assert eng.cold_path.snapshot() == {"cuda_graph_capture": 1}


def test_one_shot_or_nccl_by_message():
    bf16, f32, f16 = torch.bfloat16, torch.float32, torch.float16
    assert use_one_shot(64 * 576 * 2, bf16, bf16)  # a decode step's hidden states
    assert use_one_shot(256 * 1024, f32, f32, 256 * 1024)
    assert not use_one_shot(256 * 1024 + 4, f32, f32, 256 * 1024)  # prefill-sized: NCCL
    assert not use_one_shot(1024, bf16, None)  # no symmetric memory on this group
    assert not use_one_shot(1024, f32, bf16)  # not the buffer's dtype
    assert not use_one_shot(1024, f16, f16)  # no one-shot kernel for float16
    assert not use_one_shot(0, f32, f32)
    assert not use_one_shot(2 * 575, bf16, bf16)  # odd bfloat16 count: the kernel needs 4 B


def test_rank_devices():
    assert rank_device("cuda", 1) == torch.device("cuda", 1)
    assert rank_device("cuda:2", 1) == torch.device("cuda", 3)
    assert rank_device("cpu", 3) == torch.device("cpu")
    assert on_gpu("cuda:1") and not on_gpu("cpu")


def test_uneven_shards_gather_in_rank_order():
    sizes = [5, 4, 4]  # a vocabulary of 13 over 3 ranks
    full = torch.arange(2 * 13, dtype=torch.float32).view(2, 13)
    shards = full.split(sizes, dim=1)
    padded = torch.stack([pad_columns(s, max(sizes)) for s in shards])
    assert padded.shape == (3, 2, 5) and torch.all(padded[1:, :, 4] == 0)
    assert torch.equal(assemble_gathered(padded, sizes), full)


def _gloo_rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from backend.parallel.gpu_comm import GpuCommunicator
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
    comm = GpuCommunicator(rank, 2, torch.device("cpu"), store, torch.float32, timeout,
                           backend="gloo")
    x = torch.full((3, 4), float(rank + 1))
    reduced = comm.all_reduce(x.clone())
    shard = torch.arange(2 * (5 - rank), dtype=torch.float32).view(2, -1) + 100 * rank
    gathered = comm.gather_first(shard, [5, 4])
    comm.close()
    out.put((rank, reduced, gathered, comm.calls))


def test_gpu_communicator_collectives_over_gloo():
    """GpuCommunicator's NCCL-path logic with gloo on CPU (two processes): sum, uneven gather
    to rank 0 only. The one-shot symmetric-memory path needs GPUs (tests/gpu/check.sh)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict((r, rest) for r, *rest in (out.get(timeout=60) for _ in procs))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for r in (0, 1):
        assert torch.equal(results[r][0], torch.full((3, 4), 3.0)) and results[r][2] == 2
    want = torch.cat([torch.arange(10.).view(2, 5), torch.arange(8.).view(2, 4) + 100], dim=1)
    assert torch.equal(results[0][1], want) and results[1][1] is None


def test_replica_device_follows_instance_kind():
    cpu, gpu = Placement("cpu"), Placement("cuda", (0, 1))
    assert engine_device(cpu) == "cpu" and engine_device(gpu) == "cuda"  # KIND_CPU stays on CPU
    assert engine_device(gpu, "auto") == "cuda" and engine_device(cpu, "cpu") == "cpu"
    with pytest.raises(PlacementError, match="contradicts.*KIND_CPU"):
        engine_device(gpu, "cpu")
    with pytest.raises(PlacementError, match="contradicts.*KIND_MODEL"):
        engine_device(cpu, "cuda")
    with pytest.raises(PlacementError, match="gpu_device_ids"):
        engine_device(gpu, "cuda:1")
    kw, _ = parse_parameters({"parameters": {"device": {"string_value": "cuda"},
                                             "cuda_graphs": {"string_value": "false"}}})
    assert kw == {"device": "cuda", "cuda_graphs": False}
