"""Tensor parallelism: same tokens and logits as TP 1, exact shared-memory collectives, no
leaked worker processes."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import time

import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.sequence import Sequence
from backend.engine.step_inputs import build_step_inputs
from backend.parallel.shm_comm import ShmCommunicator
from tests.conftest import SMALL_ENGINE
from tests.required import no_cpu_kernels, portable_build_loaded
from tests.test_model_fidelity import SMOL_PROMPTS
from tests.tiny_models import make_tiny_checkpoint


def _prompt_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, run through all ranks of the engine's group."""
    eng = llm.engine
    seq = Sequence("probe", list(token_ids), len(token_ids), SamplingParams(), 0)
    assert eng.kv.allocate(seq, len(token_ids))
    try:
        inputs, *_ = build_step_inputs([(seq, len(token_ids))], eng.kv.block_size)
        inputs.logits_indices = np.arange(len(token_ids))
        if eng.group is not None:
            eng.group.broadcast(inputs)
        return eng.runner.forward(inputs)
    finally:
        eng.kv.free(seq)


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] != "Z":
                    alive.append(pid)
        except (ProcessLookupError, FileNotFoundError):
            pass
    return alive


# Structured output under TP: rank 0 samples, so its mask needs nothing from the other ranks.
GUIDED = SamplingParams(temperature=0, max_tokens=32, guided_json={
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "year": {"type": "integer", "minimum": 1000,
                                              "maximum": 2100}}, "required": ["city", "year"]})


@pytest.fixture(scope="module")
def tp1_reference(default_model_dir):
    with LLM(model=str(default_model_dir), **SMALL_ENGINE) as llm:
        sp = SamplingParams(temperature=0, max_tokens=24)
        tokens = [o.token_ids for o in llm.generate(SMOL_PROMPTS + SMOL_PROMPTS[:1],
                                                    [sp] * len(SMOL_PROMPTS) + [GUIDED])]
        probe = llm.tokenizer.encode(SMOL_PROMPTS[2])
        return tokens, probe, _prompt_logits(llm, probe)


@pytest.mark.parametrize("tp", [2, 4])
def test_smollm_tp_matches_tp1(tp, default_model_dir, tp1_reference):
    tokens, probe, logits = tp1_reference
    llm = LLM(model=str(default_model_dir), tensor_parallel_size=tp, **SMALL_ENGINE)
    pids = llm.engine.group.worker_pids
    assert len(pids) == tp - 1 and len(_pids_alive(pids)) == tp - 1
    try:
        sp = SamplingParams(temperature=0, max_tokens=24)
        outs = llm.generate(SMOL_PROMPTS + SMOL_PROMPTS[:1], [sp] * len(SMOL_PROMPTS) + [GUIDED])
        assert [o.token_ids for o in outs] == tokens  # the constrained last one too
        # rank 0's layer shards decode from 4-bit copies (cpu_blocks.py; the other ranks load
        # theirs the same way), as TP1's whole layers did
        from tpllm_kernels import cpu_ops
        assert llm.engine.runner.block_copy_bytes > 0 or cpu_ops.keep_block_copy is None
        # greedy-only steps screened each rank's vocabulary slice (greedy_head.py)
        # (the portable kernel build has no screen: the rest is checked there too)
        screen = llm.engine.runner.model.lm_head.screen
        if screen is None and not portable_build_loaded():
            no_cpu_kernels("no greedy screening without the C++ kernels' bf16 GEMV")
        if screen is not None:
            assert screen.rows > 0 and llm.engine.group.screening_everywhere
            # a rank that cannot screen (it said so when ready): no screened steps, same tokens
            llm.engine.group.screening_everywhere, rows = False, screen.rows
            again = llm.generate(SMOL_PROMPTS[:2], SamplingParams(temperature=0, max_tokens=24))
            assert [o.token_ids for o in again] == tokens[:2] and screen.rows == rows
            llm.engine.group.screening_everywhere = True
        assert outs[-1].finish_reason == "stop" and json.loads(outs[-1].text)["year"] >= 1000
        assert all(o.metrics["collective_s"] > 0 for o in outs)
        ours = _prompt_logits(llm, probe)
        rel = ((ours - logits).abs().max() / logits.abs().max()).item()
        assert rel <= 1e-5, f"TP{tp} logits relative error {rel:.2e}"
    finally:
        llm.close()
    assert _pids_alive(pids) == []


@pytest.mark.parametrize("stack", [True, False])
def test_fused_decode_collectives_late_peer_path(stack, default_model_dir, tp1_reference,
                                                 monkeypatch):
    """Decode steps do each all-reduce inside C++: every layer in one call (stack), or per layer
    half. When a peer has not arrived within the kernel's spins (forced here: no spins at all on
    rank 0), the kernel returns the posted partial, Python waits and sums (and the stack resumes
    at the next half): still the TP1 tokens."""
    tokens, _, _ = tp1_reference
    llm = LLM(model=str(default_model_dir), tensor_parallel_size=2, **SMALL_ENGINE)
    try:
        comm = llm.engine.group.comm
        if comm._native is None:
            no_cpu_kernels()
        comm._native_spins = 0
        late = []
        if stack:
            done = comm.stack_done
            monkeypatch.setattr(comm, "stack_done", lambda out, count, arrived, *a: late.append(
                not arrived) or done(out, count, arrived, *a))
        else:
            monkeypatch.setattr(comm, "fused_stack", lambda *a: None)
            finish = comm.finish_fused
            monkeypatch.setattr(comm, "finish_fused", lambda out, arrived, *a: late.append(
                not arrived) or finish(out, arrived, *a))
        outs = llm.generate(SMOL_PROMPTS, SamplingParams(temperature=0, max_tokens=24))
        assert [o.token_ids for o in outs] == tokens[:len(SMOL_PROMPTS)]
        assert any(late) and not all(late)  # both paths ran
    finally:
        llm.close()


def test_tiny_qwen2_qkv_bias_tp(tmp_path):
    make_tiny_checkpoint("qwen2", tmp_path, num_heads=6, num_kv_heads=2)
    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(model=str(tmp_path), num_kv_blocks=64, block_size=8) as ref:
        want = [o.token_ids for o in ref.generate(prompts, sp)]
        ref_logits = _prompt_logits(ref, prompts[0])
    for tp in (2, 4):  # 6 heads over 4 ranks: uneven heads, KV heads shared across ranks
        with LLM(model=str(tmp_path), tensor_parallel_size=tp, num_kv_blocks=64,
                 block_size=8) as llm:
            assert [o.token_ids for o in llm.generate(prompts, sp)] == want
            got = _prompt_logits(llm, prompts[0])
            assert ((got - ref_logits).abs().max() / ref_logits.abs().max()).item() <= 1e-5


def test_biased_layers_tp_late_peers(tmp_path):
    """Row-parallel biases (o, down) are added once, after the sum, on every decode path of a TP
    rank: inside the fused stack, and by Python after a collective a peer was late for (forced:
    no spins on rank 0)."""
    make_tiny_checkpoint("llama", tmp_path, bias=True)
    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(model=str(tmp_path), num_kv_blocks=64, block_size=8) as ref:
        want = [o.token_ids for o in ref.generate(prompts, sp)]
    with LLM(model=str(tmp_path), tensor_parallel_size=2, num_kv_blocks=64, block_size=8) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.o_proj.bias is not None
        assert [o.token_ids for o in llm.generate(prompts, sp)] == want
        llm.engine.group.comm._native_spins = 0
        assert [o.token_ids for o in llm.generate(prompts, sp)] == want


def _reduce(comm: ShmCommunicator, x: torch.Tensor, i: int) -> torch.Tensor:
    """Every other all-reduce takes its input computed into reduce_slot (no copy), if offered."""
    slot = comm.reduce_slot(1, x.numel(), x.dtype) if i % 2 else None
    if slot is None:
        return comm.all_reduce(x)
    slot.copy_(x.view(1, -1))
    return comm.all_reduce(slot).view(-1)


def _allreduce_worker(name, rank, world, sizes, seed, q, native=True):
    comm = ShmCommunicator(name, rank, world, 4 * 5000, torch.float32, create=False)
    if not native:
        comm._native = None  # the torch-op path (no C++ kernels built)
    results = []
    for i, n in enumerate(sizes):
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1000 * i + rank))
        results.append(_reduce(comm, x, i))
    time.sleep(0.05)  # rank 0 reaches the gather first: its late-peer path
    part = torch.full((3, rank + 1), float(rank))
    slot = comm.gather_slot(3, rank + 1, torch.float32) if rank == 1 else None  # rank 2 copies
    gathered = comm.gather_first(part if slot is None else slot.copy_(part), [1, 2, 3][:world])
    # the part computed into gather_slot was posted from there (no copy)
    posted = comm._slots[comm._seq & 1][rank, :3 * (rank + 1)]
    in_place = slot is None or slot.data_ptr() == posted.data_ptr()
    q.put((rank, [r.numpy() for r in results], gathered is None and in_place))
    comm.close()


def _oversized_worker(spec, q):
    import datetime

    from backend.parallel.comm_select import connect, rendezvous_store
    timeout = datetime.timedelta(seconds=60)
    store = rendezvous_store(spec, timeout)
    comm = connect(spec, store, torch.float32, timeout, peers_alive=lambda: True)
    x = torch.full((300,), float(spec.rank + 1))  # 1200 bytes: over the 256-byte slot
    q.put(comm.all_reduce(x).numpy())
    comm.close()


def test_message_over_the_slot_goes_through_gloo(tmp_path):
    """The shm communicator's fallback (a gloo group formed at the first oversized message)."""
    from dataclasses import replace

    from backend.parallel.spec import WorkerSpec
    name = f"tpllm_test_{secrets.token_hex(4)}"
    owner = ShmCommunicator(name, 0, 2, 256, torch.float32, create=True)
    base = WorkerSpec(rank=0, world=2, store_path=str(tmp_path / "store"), shm_name=name,
                      slot_bytes=256, model_dir="", dtype="float32", num_blocks=1, block_size=1,
                      max_model_len=2, num_threads=1, cpu=None)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_oversized_worker, args=(replace(base, rank=r), q))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
        owner.close(unlink=True)
    for r in results:
        assert np.array_equal(r, np.full(300, 3.0, dtype=np.float32))


@pytest.mark.parametrize("world, native", [(2, True), (3, True), (3, False), (2, "mixed")])
def test_shm_all_reduce_equals_sum(world, native):
    """The C++ path, the torch-op path, and a mix (rank 0 native, the peer not): one protocol;
    inputs computed into the slot (reduce_slot) or copied there, alternately."""
    sizes = [1, 7, 576, 4095, 5000, 3, 1000]
    name = f"tpllm_test_{secrets.token_hex(4)}"
    owner = ShmCommunicator(name, 0, world, 4 * 5000, torch.float32, create=True)
    if native is False:
        owner._native = None
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker,
                         args=(name, r, world, sizes, 7, q, native is True))
             for r in range(1, world)]
    for p in procs:
        p.start()
    try:
        mine = []
        for i, n in enumerate(sizes):
            mine.append(_reduce(owner, torch.randn(n, generator=torch.Generator().manual_seed(
                7 + 1000 * i)), i))
        owner._native_spins, waits = 0, []
        wait_all = owner._wait_all
        owner._wait_all = lambda seq: waits.append(seq) or wait_all(seq)
        gathered = owner.gather_first(torch.zeros(3, 1), [1, 2, 3][:world])
        assert waits  # the peers were late: rank 0 waited the Python way
        others = dict((r, (res, ok)) for r, res, ok in (q.get(timeout=60) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
        owner.close(unlink=True)
    for i, n in enumerate(sizes):
        expect = sum(torch.randn(n, generator=torch.Generator().manual_seed(7 + 1000 * i + r))
                     for r in range(world))
        torch.testing.assert_close(mine[i], expect, rtol=1e-6, atol=1e-6)
        for r in range(1, world):  # bit-identical on every rank
            assert np.array_equal(others[r][0][i], mine[i].numpy())
    assert all(ok for _, ok in others.values())  # no gathered result off rank 0; in place
    expect_g = torch.cat([torch.full((3, r + 1), float(r)) for r in range(world)], dim=1)
    assert torch.equal(gathered, expect_g)


def test_gloo_transport_matches_shared_memory(tmp_path, monkeypatch):
    """TPLLM_TP_TRANSPORT=gloo (the between-hosts transport) gives the same tokens as TP 1, and
    every collective really goes through it."""
    from backend.parallel.gloo_comm import GlooCommunicator
    make_tiny_checkpoint("qwen2", tmp_path, num_heads=6, num_kv_heads=2)
    prompts = [list(range(5 + i, 30 + 3 * i)) for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(model=str(tmp_path), num_kv_blocks=64, block_size=8, warmup=False) as ref:
        want = [o.token_ids for o in ref.generate(prompts, sp)]
    monkeypatch.setenv("TPLLM_TP_TRANSPORT", "gloo")
    with LLM(model=str(tmp_path), tensor_parallel_size=2, num_kv_blocks=64, block_size=8,
             warmup=False) as llm:
        comm = llm.engine.group.comm
        assert isinstance(comm, GlooCommunicator)
        assert [o.token_ids for o in llm.generate(prompts, sp)] == want
        assert comm.calls > 0 and comm.seconds > 0


def test_warmup_with_few_sequences(tmp_path):
    """Warmup's mixed steps sample no more rows than max_num_seqs: the TP logits gather is sized
    for that many (was: 9 rows against a slot for 2)."""
    make_tiny_checkpoint("llama", tmp_path)
    with LLM(model=str(tmp_path), tensor_parallel_size=2, num_kv_blocks=32, block_size=8,
             max_num_seqs=2, max_num_batched_tokens=64) as llm:
        assert llm.stats["warmup_seconds"] > 0
        out = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert [len(o.token_ids) for o in out] == [3, 3]
        assert llm.engine.cold_path.total == 0


def test_mlp_split_is_even_whatever_the_heads():
    """The MLP is a segment between two collectives, so it splits evenly on its own even when
    the heads split 4 + 5 (moving rows to balance whole layers made ranks wait at both)."""
    from backend.model.config import ModelConfig
    from backend.model.llama import MLP
    from backend.parallel.context import ParallelContext
    cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 72,
                                 "intermediate_size": 1536, "num_hidden_layers": 1,
                                 "num_attention_heads": 9, "num_key_value_heads": 3})
    rows = [MLP(cfg, ParallelContext(r, 2, None), torch.float32).down_proj.weight.shape[1]
            for r in range(2)]
    assert rows == [768, 768]


def test_failed_start_leaves_nothing(tmp_path, monkeypatch):
    """A group that fails half-way through its start (workers spawned, communicator not formed)
    raises, and removes its workers, shared-memory segment and rendezvous directory (before, the
    engine never got the half-built group to close, and all three leaked)."""
    import tempfile

    from backend.engine.tp import group

    def broken_connect(*args, **kwargs):
        raise RuntimeError("no communicator today")

    make_tiny_checkpoint("llama", tmp_path / "model")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(group, "connect", broken_connect)
    shm_before = set(os.listdir("/dev/shm"))
    children_before = set(mp.active_children())
    with pytest.raises(RuntimeError, match="no communicator today"):
        LLM(model=str(tmp_path / "model"), tensor_parallel_size=2, num_kv_blocks=16,
            warmup=False)
    assert not list(tmp_path.glob("tpllm-tp-*"))
    assert {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("tpllm_")} == set()
    assert set(mp.active_children()) - children_before == set()


def test_unguarded_script_start_names_the_main_guard(tmp_path):
    """A script that starts LLM(tensor_parallel_size=2) at top level, without
    `if __name__ == "__main__":`: each spawned worker re-imports it and dies bootstrapping. The
    start-up error says so (before: only "rank 1 exited during start-up (exit code 1)")."""
    import subprocess
    import sys

    make_tiny_checkpoint("llama", tmp_path / "model")
    script = tmp_path / "unguarded.py"
    script.write_text("from backend import LLM\n"
                      f"llm = LLM(model={str(tmp_path / 'model')!r}, tensor_parallel_size=2, "
                      "num_kv_blocks=16, warmup=False)\n")
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert "tensor-parallel rank 1 exited during start-up" in last, run.stderr[-3000:]
    assert f"re-imports the main script ({script})" in last
    assert 'if __name__ == "__main__":' in last


@pytest.mark.parametrize("spin_s", [0.0, 0.05])
def test_worker_waits_for_the_next_step_polling_or_blocking(spin_s):
    """A worker polls for the next step for a while, then blocks: either way it gets the message
    (sent after its polling ran out too) and sees a closed channel as EOF."""
    import threading

    from backend.engine.tp.worker import _next_message
    a, b = mp.Pipe()
    threading.Timer(0.1, lambda: b.send_bytes(b"step")).start()
    assert _next_message(a, spin_s) == b"step"
    b.close()
    with pytest.raises(EOFError):
        _next_message(a, spin_s)
