"""Automatic prefix caching: block keys, reference counts, LRU eviction, and the engine's outputs
with caching on equal to caching off (tiny models) and to transformers (SmolLM2)."""
from __future__ import annotations

import random

import pytest

from backend import LLM, AsyncEngine, SamplingParams
from backend.engine.buckets import BucketPlan
from backend.engine.kv_manager import KVCacheManager
from backend.engine.scheduler import Scheduler
from backend.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(str(i), list(tokens), len(tokens), SamplingParams(), arrival=i)


def _computed(kv: KVCacheManager, i: int, tokens: list[int]) -> Sequence:
    """A sequence admitted with its cached prefix, then fully computed (not freed)."""
    seq = _seq(i, tokens)
    prefix = kv.match_prefix(seq)
    assert kv.allocate(seq, len(tokens), prefix=prefix)
    seq.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(seq)
    return seq


# ---- the KV manager alone ---------------------------------------------------------------------
def test_keys_chain_the_whole_prefix():
    kv = KVCacheManager(16, 4)
    a = _computed(kv, 0, list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.num_cached_blocks == 2
    assert kv.match_prefix(_seq(1, list(range(8)) + [50, 51, 52])) == a.block_table[:2]
    assert kv.match_prefix(_seq(2, list(range(6)) + [50, 51, 52])) == a.block_table[:1]
    # block 1's tokens equal a's block 1, but behind a different block 0: no hit at all
    assert kv.match_prefix(_seq(3, [99, 1, 2, 3] + list(range(4, 10)))) == []


def test_last_token_is_never_served_from_the_cache():
    kv = KVCacheManager(16, 4)
    a = _computed(kv, 0, list(range(12)))
    assert kv.num_cached_blocks == 3
    # the exact prompt again: its last block is recomputed (never written while shared)
    assert kv.match_prefix(_seq(1, list(range(12)))) == a.block_table[:2]
    # one token more: every full block hits, the one new token is computed
    assert kv.match_prefix(_seq(2, list(range(13)))) == a.block_table[:3]


def test_shared_blocks_are_counted_and_returned_at_zero():
    kv = KVCacheManager(8, 4)
    a = _computed(kv, 0, list(range(9)))  # 3 blocks
    b = _computed(kv, 1, list(range(8)) + [70, 71, 72])  # shares a's 2 full blocks
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [kv.ref_count(x) for x in a.block_table] == [2, 2, 1]
    assert kv.num_free_blocks == 4
    kv.free(a)
    kv.check([b])
    assert [kv.ref_count(x) for x in b.block_table] == [1, 1, 1]
    assert kv.num_free_blocks == 5  # a's partial block only; the shared ones are still owned
    # a shared (owned) block is never evicted: a request for every free block and one more fails
    c = _seq(2, list(range(100, 124)))
    assert not kv.allocate(c, 24) and c.block_table == []
    kv.free(b)
    kv.check([])
    assert kv.num_free_blocks == 8 and kv.num_cached_blocks == 2


def test_empty_blocks_first_then_least_recently_released():
    kv = KVCacheManager(8, 2)
    a = _computed(kv, 0, [1, 2, 3, 4, 5])  # 2 keyed blocks + a partial one
    b = _computed(kv, 1, [11, 12, 13, 14, 15])
    a0, a1, _ = a.block_table
    b0, b1, _ = b.block_table
    kv.free(b)  # b released first: the older
    kv.free(a)
    c = _seq(2, [21, 22, 23, 24, 25])
    assert kv.allocate(c, 5)  # 3 of the 4 empty blocks (never used, or partial)
    assert not {a0, a1, b0, b1} & set(c.block_table)
    d = _computed(kv, 3, [11, 12, 13, 14, 15])  # a hit: b's blocks become the most recent
    assert d.block_table[:2] == [b0, b1]
    kv.free(d)
    kv.free(c)
    kv.check([])
    order = []
    for i in range(8):
        e = _seq(10 + i, [200 + i])
        assert kv.allocate(e, 1)
        order += e.block_table
        if i == 4:  # a's tail went first; its head still hits
            assert kv.match_prefix(_seq(9, [1, 2, 3, 4, 5])) == [a0]
    assert not {a0, a1, b0, b1} & set(order[:4])  # empty blocks before any cached one
    assert order[4:] == [a1, a0, b1, b0]  # then LRU, each prefix's tail before its head
    assert kv.num_free_blocks == 0 and kv.num_cached_blocks == 0


def test_caching_off_keeps_nothing():
    kv = KVCacheManager(8, 4, enable_caching=False)
    a = _computed(kv, 0, list(range(9)))
    assert kv.num_cached_blocks == 0 and kv.match_prefix(_seq(1, list(range(9)))) == []
    kv.free(a)
    kv.check([])


def test_reset_forgets_prefixes_but_not_owners():
    kv = KVCacheManager(8, 4)
    a = _computed(kv, 0, list(range(9)))
    b = _computed(kv, 1, list(range(20, 29)))
    kv.free(b)
    kv.reset_prefix_cache()
    kv.check([a])
    assert kv.num_cached_blocks == 0 and kv.match_prefix(_seq(2, list(range(9)))) == []
    assert kv.num_free_blocks == 5


# ---- scheduler + KV manager under a random mix, with a shadow of the cache contents -----------
def test_random_finish_abort_preempt_never_leaks_nor_reads_stale_kv():
    """Every cache slot is shadowed by the token prefix whose K/V it holds: a step may only write
    slots of blocks it alone owns, and every token a sequence attends to must hold its own
    prefix. After each step every block is empty, cached-and-free or owned (kv.check)."""
    rng = random.Random(0)
    bs = 4
    kv = KVCacheManager(16, bs)
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=24, plan=BucketPlan.build(6, 24))
    shadow: dict[tuple[int, int], tuple] = {}
    systems = [[rng.randrange(1, 50) for _ in range(rng.randrange(3, 14))] for _ in range(3)]
    live: list[Sequence] = []
    stats = {"hits": 0, "finished": 0, "aborted": 0}
    for step in range(400):
        if rng.random() < 0.5 and len(live) < 10:
            prompt = rng.choice(systems) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 8))]
            if rng.random() < 0.2 and live:
                prompt = list(rng.choice(live).token_ids)  # an exact repeat, generated part too
            s = Sequence(str(step), prompt, len(prompt),
                         SamplingParams(max_tokens=rng.randrange(1, 30)), arrival=step)
            sched.add(s)
            live.append(s)
        out = sched.schedule()
        stats["hits"] += out.prefix_hits
        for seq, n in out.scheduled:
            c0, table = seq.num_computed_tokens, seq.block_table
            for p in range(c0):  # what this step's attention reads
                assert shadow[(table[p // bs], p % bs)] == tuple(seq.token_ids[:p + 1])
            for p in range(c0, c0 + n):  # what it writes
                assert kv.ref_count(table[p // bs]) == 1, "write into a shared block"
                shadow[(table[p // bs], p % bs)] = tuple(seq.token_ids[:p + 1])
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            kv.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(rng.randrange(1, 50))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq)
                    live.remove(seq)
                    stats["finished"] += 1
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            sched.finish(victim)
            live.remove(victim)
            stats["aborted"] += 1
        kv.check(live)
    for s in list(live):
        sched.finish(s)
    kv.check([])
    assert kv.num_free_blocks == kv.num_blocks
    stats["preemptions"] = sched.num_preemptions
    assert stats["preemptions"] > 5 and stats["hits"] > 0, stats
    assert stats["finished"] > 20 and stats["aborted"] > 2, stats


# ---- the engine on a tiny model: caching on == caching off --------------------------------------
@pytest.fixture(scope="module")
def engines(tiny_text_model):
    kw = dict(model=str(tiny_text_model), num_kv_blocks=96, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=64)
    on, off = LLM(**kw), LLM(**kw, enable_prefix_caching=False, warmup=False)  # off: reference
    yield on, off
    on.close(), off.close()


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _one_by_one(llm: LLM, prompts: list[list[int]], sp=GREEDY):
    return [llm.generate(p, sp)[0] for p in prompts]


def test_engine_outputs_equal_with_caching_off(engines):
    on, off = engines
    before = on.stats
    system = _ids(43, 1)  # ends mid-block: 5 full blocks of 8 are shareable
    questions = [system + _ids(5 + i, 10 + i) for i in range(3)]
    repeat = [_ids(32, 2)] * 2  # a whole prompt of full blocks, twice
    plus_one = [repeat[0] + [7]]  # every full block cached: one token computed (a decode row)
    prompts = questions + repeat + plus_one
    got, want = _one_by_one(on, prompts), _one_by_one(off, prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.num_cached_tokens for o in got] == [0, 40, 40, 0, 24, 32]
    assert all(o.num_cached_tokens == 0 for o in want)
    # multi-turn: each turn resends the history (with the model's answers) plus a new message
    history = _ids(20, 3)
    for turn in range(3):
        history = history + _ids(6, 30 + turn)
        g, w = on.generate(history, GREEDY)[0], off.generate(history, GREEDY)[0]
        assert g.token_ids == w.token_ids
        if turn:  # the previous turn's prompt and answer (all but its last token) were cached
            assert g.num_cached_tokens == (len(history) - 6 - 1) // 8 * 8
        history = history + g.token_ids
    s = on.stats
    assert s["prefix_cache_hits"] - before["prefix_cache_hits"] == 80 + 56 + 72
    assert s["prefix_cache_queries"] > s["prefix_cache_hits"]
    assert off.stats["prefix_cache_queries"] == 0
    assert on.stats["cold_path"] == {}  # prefix hits still run warmed step shapes


def test_concurrent_requests_share_a_prefix_still_being_prefilled(tiny_text_model):
    """A 16-token step budget spreads the first prompt over steps; the others join while it is
    still prefilling and share the blocks it has finished so far."""
    kw = dict(model=str(tiny_text_model), num_kv_blocks=96, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=16)
    system = _ids(45, 4)
    prompts = [system + _ids(4, 40 + i) for i in range(4)]
    with LLM(**kw) as on, LLM(**kw, enable_prefix_caching=False, warmup=False) as off:
        got, want = on.generate(prompts, GREEDY), off.generate(prompts, GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got[0].num_cached_tokens == 0 and max(o.num_cached_tokens for o in got) > 0
        assert on.stats["cold_path"] == {}
        on.engine.kv.check([])


def test_kv_pressure_with_caching_on(tiny_text_model):
    """A pool far too small: preemptions and evictions, same tokens, no block leaked."""
    system = _ids(30, 5)
    prompts = [system + _ids(3 + i % 4, 50 + i) for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(model=str(tiny_text_model), num_kv_blocks=256, block_size=4,
             enable_prefix_caching=False, warmup=False) as roomy:
        want = [o.token_ids for o in roomy.generate(prompts, sp)]
    with LLM(model=str(tiny_text_model), num_kv_blocks=20, block_size=4,
             max_num_batched_tokens=16) as tight:
        assert [o.token_ids for o in tight.generate(prompts, sp)] == want
        assert [o.token_ids for o in tight.generate(prompts[::-1], sp)] == want[::-1]
        assert tight.stats["preemptions"] > 0 and tight.stats["prefix_cache_hits"] > 0
        tight.engine.kv.check([])
        assert tight.engine.kv.num_free_blocks == 20
        assert tight.stats["cold_path"] == {}


def test_abort_of_a_sharer_leaves_the_other_intact(engines):
    on, off = engines
    prompt = _ids(40, 6)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = off.generate(prompt, sp)[0].token_ids
    on.generate(prompt, SamplingParams(temperature=0, max_tokens=1))  # cache the prefix
    engine = AsyncEngine(on.engine)
    try:
        keeper = engine.add_request("keeper", prompt, sp)
        victim = engine.add_request("victim", prompt, SamplingParams(
            temperature=0, max_tokens=400, ignore_eos=True))
        assert not victim.get(timeout=60).finished
        engine.abort("victim")
        assert list(victim)[-1].finish_reason == "abort"
        outs = list(keeper)
        assert [t for o in outs for t in o.token_ids] == want
        assert outs[-1].finish_reason == "length" and outs[-1].num_cached_tokens == 32
    finally:
        engine.shutdown()
    on.engine.kv.check([])


def test_tensor_parallel_follows_rank_zero(tiny_text_model):
    system = _ids(37, 7)
    prompts = [system + _ids(5, 70 + i) for i in range(3)]
    kw = dict(model=str(tiny_text_model), num_kv_blocks=64, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=64)
    with LLM(**kw, enable_prefix_caching=False, warmup=False) as off:
        want = [o.token_ids for o in _one_by_one(off, prompts)]
    with LLM(**kw, tensor_parallel_size=2, warmup=False) as tp:  # warmup: tested at TP 1
        got = _one_by_one(tp, prompts)
        assert [o.token_ids for o in got] == want
        assert [o.num_cached_tokens for o in got] == [0, 32, 32]


# ---- the real model against transformers --------------------------------------------------------
def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    import torch
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_smollm_shared_system_prompt_and_chat_match_transformers(smollm, hf_smollm):
    tok = smollm.tokenizer
    system = ("You are a careful assistant for a hardware store. Answer in one short sentence, "
              "name the aisle when you can, and never invent products. The store has aisles for "
              "paint, garden tools, plumbing, electrical supplies, lumber and fasteners.")
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("Where are the hammers?", "Do you sell garden hoses?",
                       "What is the capital of France?")]
    sp = SamplingParams(temperature=0, max_tokens=16)
    hits0 = smollm.stats["prefix_cache_hits"]
    outs = []
    for msgs in chats:
        ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
        out = smollm.generate(ids, sp)[0]
        assert out.token_ids == _hf_greedy(hf_smollm, ids, 16), msgs[-1]
        outs.append(out)
    assert outs[1].num_cached_tokens >= 48 and outs[2].num_cached_tokens >= 48
    # the conversation goes on: the history (with the answer) is resent with a new question
    msgs = chats[0] + [{"role": "assistant", "content": outs[0].text},
                       {"role": "user", "content": "And the nails?"}]
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    out = smollm.generate(ids, sp)[0]
    assert out.token_ids == _hf_greedy(hf_smollm, ids, 16)
    assert out.num_cached_tokens >= 64
    assert smollm.stats["prefix_cache_hits"] > hits0
