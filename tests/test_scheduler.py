"""Scheduler and KV-block bookkeeping: chunked prefill, decode priority, preemption, FCFS."""
from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.kv_manager import KVCacheManager
from backend.engine.scheduler import Scheduler
from backend.engine.sequence import Sequence, Status
from tests.tiny_models import make_tiny_checkpoint


def _seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(str(i), list(range(prompt_len)), prompt_len, SamplingParams(), arrival=i)


def _run_step(sched: Scheduler) -> list[tuple[str, int]]:
    """Schedule, pretend the model ran, append a token to every sequence that sampled."""
    out = sched.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return [(s.request_id, n) for s, n in out.scheduled]


def test_chunked_prefill_respects_budget_and_boundaries():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)
    sched.add(_seq(0, 20))
    assert _run_step(sched) == [("0", 8)]
    assert _run_step(sched) == [("0", 8)]
    assert _run_step(sched) == [("0", 4)]  # last chunk samples the first token
    assert _run_step(sched) == [("0", 1)]  # decode
    seq = sched.running[0]
    assert seq.num_computed_tokens == 21 and len(seq.block_table) == kv.blocks_for(22)


def test_decodes_go_first_and_prefill_takes_the_rest():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)
    sched.add(_seq(0, 3))
    assert _run_step(sched) == [("0", 3)]
    sched.add(_seq(1, 30))
    assert _run_step(sched) == [("0", 1), ("1", 7)]
    assert _run_step(sched) == [("0", 1), ("1", 7)]


def test_max_num_seqs_and_fcfs_admission():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add(_seq(i, 5))
    assert [r for r, _ in _run_step(sched)] == ["0", "1"]
    assert [s.request_id for s in sched.waiting] == ["2", "3"]
    sched.finish(sched.running[0])
    assert [r for r, _ in _run_step(sched)] == ["1", "2"]


def test_waiting_requests_are_admitted_in_groups_that_minimize_time_to_first_token():
    """n requests waiting, t tokens each, a step overhead of F tokens: a step admits new ones
    until it holds sqrt(n F t) prompt tokens, at least one; none overtakes an older one."""
    kv = KVCacheManager(num_blocks=256, block_size=4)
    sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=2048, step_overhead_tokens=16)
    for i in range(8):
        sched.add(_seq(i, 36))
    assert _run_step(sched) == [("0", 36), ("1", 36)]  # sqrt(8 * 16 * 36) = 68 tokens
    assert _run_step(sched) == [("0", 1), ("1", 1), ("2", 36), ("3", 36)]  # sqrt(6*16*36) = 59
    assert _run_step(sched)[4:] == [("4", 36), ("5", 36)]  # 48: the second starts below it
    assert _run_step(sched)[6:] == [("6", 36)]  # 34: one
    assert _run_step(sched)[7:] == [("7", 36)]
    # without the overhead (CUDA's default) they all join the first step, as the budget allows
    sched = Scheduler(KVCacheManager(num_blocks=256, block_size=4), 16, 2048)
    for i in range(8):
        sched.add(_seq(i, 36))
    assert len(_run_step(sched)) == 8
    # long prompts go one a step: each alone is past sqrt(4 * 16 * 256) = 128
    sched = Scheduler(KVCacheManager(num_blocks=1024, block_size=4), 16, 2048,
                      step_overhead_tokens=16)
    for i in range(4):
        sched.add(_seq(i, 256))
    assert _run_step(sched) == [("0", 256)]
    assert _run_step(sched) == [("0", 1), ("1", 256)]


def test_preemption_frees_youngest_and_recomputes():
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 16 tokens in all
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    sched.add(_seq(0, 7))
    sched.add(_seq(1, 7))
    assert _run_step(sched) == [("0", 7), ("1", 7)]  # 2 blocks each: pool full
    assert _run_step(sched) == [("0", 1), ("1", 1)]  # the 8th token still fits in 2 blocks
    out = sched.schedule()  # both need a third block: the younger one is preempted
    assert [s.request_id for s, _ in out.scheduled] == ["0"]
    assert [s.request_id for s in out.preempted] == ["1"]
    victim = out.preempted[0]
    assert victim.status is Status.WAITING and victim.block_table == []
    assert victim.num_computed_tokens == 0 and victim.num_tokens == 9  # tokens kept
    assert kv.num_free_blocks == 1


def test_blocks_all_returned_after_finish_and_abort():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [_seq(i, 9) for i in range(3)]
    for s in seqs:
        sched.add(s)
    _run_step(sched)
    assert kv.num_free_blocks < 16
    for s in seqs:
        sched.finish(s)
    assert kv.num_free_blocks == 16 and not sched.has_work()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_llama"))


def test_preemption_under_tiny_pool_keeps_outputs_exact(tiny_dir):
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (10, 13, 6, 21, 9, 17)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = LLM(model=str(tiny_dir), num_kv_blocks=128, block_size=4)
    expected = [roomy.generate(p, sp)[0].token_ids for p in prompts]
    # 14 blocks x 4 = 56 tokens, while the six requests need up to 45 tokens each
    tight = LLM(model=str(tiny_dir), num_kv_blocks=14, block_size=4, max_num_batched_tokens=16)
    outs = tight.generate(prompts, sp)
    assert [o.token_ids for o in outs] == expected
    assert tight.stats["preemptions"] > 0
    assert tight.engine.kv.num_free_blocks == 14
    assert not tight.engine.scheduler.has_work()


def test_request_larger_than_pool_is_rejected(tiny_dir):
    llm = LLM(model=str(tiny_dir), num_kv_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="max_tokens.*KV cache"):
        llm.generate(list(range(3, 13)), SamplingParams(max_tokens=10))
