"""The engine's request-level behaviour: streaming, abort, seeds, stops, limits, validation."""
from __future__ import annotations

import threading

import pytest

from backend import LLM, AsyncEngine, SamplingParams
from tests.required import no_cpu_kernels, not_in_portable_build


@pytest.fixture(scope="module")
def llm(tiny_text_model):
    return LLM(model=str(tiny_text_model), num_kv_blocks=256, block_size=8)


def test_offline_api_shape(llm):
    outs = llm.generate(["Hello there", "Bonjour"], SamplingParams(temperature=0, max_tokens=5,
                                                                   ignore_eos=True))
    assert len(outs) == 2
    for o in outs:
        assert o.finish_reason == "length" and len(o.token_ids) == 5
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    assert outs[0].num_input_tokens == len(llm.tokenizer.encode("Hello there"))


def test_same_seed_same_text_regardless_of_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate("A story:", sp)[0].token_ids
    others = SamplingParams(temperature=1.2, max_tokens=7, ignore_eos=True)
    batch = llm.generate(["Other", "A story:", "More"], [others, sp, others])
    assert batch[1].token_ids == alone
    different = llm.generate("A story:", SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12,
                                                        seed=99, ignore_eos=True))[0].token_ids
    assert different != alone


def test_stop_string_never_leaks(llm):
    free = llm.generate("Count:", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = llm.generate("Count:", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and free.text.startswith(out.text)
    assert out.text == free.text[:free.text.index(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    free = llm.generate("Go", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    tok = free.token_ids[2]
    out = llm.generate("Go", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                            stop_token_ids=[tok]))[0]
    first = free.token_ids.index(tok)
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]
    forced = llm.generate("Go", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                               stop_token_ids=[tok], min_tokens=first + 2))[0]
    assert len(forced.token_ids) >= first + 2


def test_logprobs_accumulate(llm, tiny_text_model):
    """cumulative_logprob is the sum of log_softmax(logits)[token] over the output, greedy or
    sampled (raw: before temperature), as transformers computes it on the same checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.test_model_fidelity import hf_output_logprob
    hf = AutoModelForCausalLM.from_pretrained(tiny_text_model, dtype=torch.float32).eval()
    prompt = llm.tokenizer.encode("Hi")
    for sp in (SamplingParams(temperature=0, max_tokens=4, logprobs=True, ignore_eos=True),
               SamplingParams(temperature=1.5, seed=5, max_tokens=4, logprobs=True,
                              ignore_eos=True)):
        out = llm.generate("Hi", sp)[0]
        assert out.num_input_tokens == len(prompt) and len(out.token_ids) == 4
        want = hf_output_logprob(hf, prompt, out.token_ids)
        assert out.cumulative_logprob == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].cumulative_logprob is None


@pytest.mark.parametrize("bad, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-3), "top_k"), (dict(min_p=2.0), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=5.0), "presence_penalty"), (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"), (dict(stop=[""]), "stop"), (dict(stop=["x"] * 1000), "stop"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_invalid_sampling_params_name_the_field(bad, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**bad)


def test_invalid_prompts_name_the_field(llm):
    with pytest.raises(ValueError, match="^text_input:"):
        llm.generate("", SamplingParams())
    with pytest.raises(ValueError, match="^text_input:"):
        llm.generate([10**9], SamplingParams())
    long_prompt = " ".join(["word"] * 2000)
    with pytest.raises(ValueError, match="^(text_input|max_tokens):"):
        llm.generate(long_prompt, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="^max_tokens:.*context"):
        llm.generate("hi", SamplingParams(max_tokens=5000))


def test_async_streaming_deltas_reassemble(llm):
    engine = AsyncEngine(llm.engine)
    try:
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        expected = llm.generate("Stream me", sp)[0]
        streams = [engine.add_request(f"s{i}", "Stream me", sp) for i in range(4)]
        for s in streams:
            outs = list(s)
            assert "".join(o.text for o in outs) == expected.text
            assert [t for o in outs for t in o.token_ids] == expected.token_ids
            assert outs[-1].finished and outs[-1].finish_reason == "length"
            assert all(not o.finished for o in outs[:-1])
    finally:
        engine.shutdown()


def test_async_abort_frees_blocks_and_others_continue(llm):
    engine = AsyncEngine(llm.engine)
    try:
        free_before = llm.engine.kv.num_free_blocks
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        victim = engine.add_request("victim", "Go on forever", long)
        keeper = engine.add_request("keeper", "Short one", SamplingParams(max_tokens=8,
                                                                          ignore_eos=True))
        first = victim.get(timeout=30)
        assert not first.finished
        engine.abort("victim")
        rest = list(victim)
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        kept = list(keeper)
        assert kept[-1].finish_reason == "length" and sum(len(o.token_ids) for o in kept) == 8
        assert llm.engine.kv.num_free_blocks == free_before
    finally:
        engine.shutdown()


def test_async_bad_request_fails_alone_and_shutdown_finishes_streams(llm):
    engine = AsyncEngine(llm.engine)
    with pytest.raises(ValueError, match="^text_input:"):
        engine.add_request("bad", "", SamplingParams())
    stream = engine.add_request("long", "Keep going", SamplingParams(max_tokens=500,
                                                                     ignore_eos=True))
    stream.get(timeout=30)
    done = threading.Event()
    threading.Thread(target=lambda: (list(stream), done.set()), daemon=True).start()
    engine.shutdown()
    assert done.wait(10)
    assert stream.finished
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def _fused_and_modular_agree(llm, prompts: list[str], monkeypatch) -> tuple[list[str], list]:
    """Runs `prompts` (then the first alone) through the fused stack, the fused halves and the
    modular path; asserts each used what it should and all three gave the same tokens and
    log-probabilities, to the bit. Returns the list the fused calls are recorded in and the
    (tokens, cumulative log-probability) of each output."""
    from tpllm_kernels import cpu_ops
    model = llm.engine.runner.model
    calls: list[str] = []
    for name in ("decode_stack", "decode_attention_half"):
        fn = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name, lambda *a, _n=name, _f=fn: calls.append(_n) or _f(*a))
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=True)

    def run(stack: bool, fused: bool):
        model.fused_stack, model.fused_decode = stack, fused
        calls.clear()
        try:
            out = [(o.token_ids, o.cumulative_logprob) for o in llm.generate(prompts, sp)
                   + llm.generate(prompts[:1], sp)]
        finally:
            model.fused_stack = model.fused_decode = True
        return out, set(calls)

    stack, used = run(True, True)
    assert used == {"decode_stack"}
    halves, used = run(False, True)
    assert used == {"decode_attention_half"}
    modular, used = run(False, False)
    assert not used
    assert stack == halves == modular
    calls.clear()
    return calls, stack


def test_decode_part_timing_sums_each_part_and_changes_no_result(llm):
    """bench step-parts' in-place timing (decode_layer.cpp part_timing): switched on, every part
    of every layer of the fused stack is summed, one attention half counted per layer and decode
    step; the tokens and log-probabilities stay the same bits; switched off, nothing is added."""
    from tpllm_kernels import cpu_ext
    model = llm.engine.runner.model
    ext = cpu_ext.load()
    if ext is None or not model.fused_decode:
        no_cpu_kernels()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    prompt = ["Where does a decode step spend its time"]
    plain = [(o.token_ids, o.cumulative_logprob) for o in llm.generate(prompt, sp)]
    ext.set_decode_part_timing(True)
    try:
        timed = [(o.token_ids, o.cumulative_logprob) for o in llm.generate(prompt, sp)]
        got = dict(ext.decode_part_seconds())
    finally:
        ext.set_decode_part_timing(False)
    assert timed == plain
    layers = len(model.layers)
    # the first token comes from the prompt's step; the other 5 from decode steps
    assert got.pop("layers") == 5 * layers
    assert set(got) == {"norm", "qkv", "rotary_kv", "attention", "o", "gate_up", "silu", "down",
                        "bias"}
    for part in ("norm", "qkv", "rotary_kv", "attention", "o", "gate_up", "silu", "down"):
        assert got[part] > 0, part
    llm.generate(prompt, sp)  # switching off cleared the sums; steps while off add nothing
    assert dict(ext.decode_part_seconds())["layers"] == 0


def test_fused_decode_layers_match_the_modular_path(llm, monkeypatch):
    """With the C++ CPU kernels, decode steps run all layers in one call (one rank), or each
    layer as two calls (tpllm_kernels/csrc/decode_layer.cpp): the same tokens and log-probabilities,
    to the bit, as the layer-by-layer path (this model is a Qwen2: qkv bias; batch 3 and 1)."""
    if not llm.engine.runner.model.fused_decode:
        no_cpu_kernels()
    _fused_and_modular_agree(llm, ["The quick brown fox", "Once upon a time there", "1 2 3"],
                             monkeypatch)


def test_fused_bf16_decode_matches_the_modular_path(tiny_text_model, monkeypatch):
    """bf16 at one rank: decode steps of up to FUSED_DECODE_BF16_ROWS rows run all layers in
    one C++ call (or two per layer) with the bf16 GEMV the modular path uses: the same tokens
    and log-probabilities, to the bit (qkv bias included); a larger batch stays modular."""
    from tpllm_kernels import cpu_ops
    if not cpu_ops.AVAILABLE or not cpu_ops.FUSED_DECODE_BF16_ROWS:
        not_in_portable_build("bf16 GEMV")
    prompts = ["The quick brown fox", "Once upon a time there"]
    assert len(prompts) == cpu_ops.FUSED_DECODE_BF16_ROWS
    with LLM(model=str(tiny_text_model), dtype="bfloat16", num_kv_blocks=256,
             block_size=8) as llm:
        calls, _ = _fused_and_modular_agree(llm, prompts, monkeypatch)
        # 3 rows: oneDNN's GEMM in the modular path, so not fused
        llm.generate(prompts + ["1 2 3"], SamplingParams(max_tokens=2, ignore_eos=True))
        assert not calls


def test_decode_reads_exact_block_copies(tmp_path, default_model_dir, monkeypatch):
    """Layers whose float32 weights are Q4_1 blocks and an lm_head of Q8_0 blocks (as the
    default model's) decode from their exact copies (tpllm_kernels/cpu_blocks.py) in the fused
    stack, the fused halves and the modular path: the same tokens and log-probabilities, to
    the bit, as without the copies; and the copies are what those steps read (spoiled, the
    tokens change)."""
    from tests.tiny_models import make_tiny_checkpoint, requantize
    from tpllm_kernels import cpu_ops
    if not cpu_ops.AVAILABLE or cpu_ops.keep_block_copy is None:
        no_cpu_kernels("no block-copy GEMV without the C++ kernels")
    model = requantize(make_tiny_checkpoint(  # hidden 96, MLP 160: whole blocks of 32
        "qwen2", tmp_path, tokenizer_dir=default_model_dir))
    prompts = ["The quick brown fox", "Once upon a time there", "1 2 3"]
    kw = dict(model=str(model), num_kv_blocks=256, block_size=8)
    with LLM(**kw) as llm:
        assert llm.engine.runner.block_copy_bytes > 0
        _, with_copies = _fused_and_modular_agree(llm, prompts, monkeypatch)
        params = llm.engine.runner.model.parameters()
        kinds = sorted(p.block_copy[0] for p in params if hasattr(p, "block_copy"))
        assert kinds == ["q4"] * 8 + ["q8"]  # qkv, o, gate_up, down of both layers; lm_head
        for p in llm.engine.runner.model.parameters():
            if hasattr(p, "block_copy"):
                p.block_copy[2].mul_(0.5)  # every scale (and a Q4 block's m) halved
        sp = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=True)
        spoiled = [(o.token_ids, o.cumulative_logprob) for o in llm.generate(prompts[:1], sp)]
        assert spoiled != with_copies[-1:]
    monkeypatch.setattr(cpu_ops, "keep_block_copy", None)
    with LLM(**kw) as llm:
        assert llm.engine.runner.block_copy_bytes == 0
        _, without = _fused_and_modular_agree(llm, prompts, monkeypatch)
    assert with_copies == without


@pytest.mark.parametrize("library", ["mkl", "onednn"])
def test_full_decode_batch_runs_from_packed_weights(tiny_text_model, monkeypatch, library):
    """On CPU the linears keep packed weights (MKL's or oneDNN's) for the largest decode
    bucket; a batch that fills it runs from them and generates what the engine without them
    does."""
    from tpllm_kernels import cpu_ops
    if not (cpu_ops._mkl_packing() if library == "mkl" else cpu_ops._onednn_available()):
        pytest.skip(f"torch without {library}'s packed GEMM")
    monkeypatch.setattr(cpu_ops, "GEMM_LIBRARY", library)
    rows = cpu_ops.SMALL_M + 8
    # all admitted in one step (no grouping), so all decode together: a full batch
    kw = dict(model=str(tiny_text_model), num_kv_blocks=256, block_size=8, max_num_seqs=rows,
              step_overhead_tokens=0)
    prompts = [f"Item {i}: the {'quick ' * (i % 5)}brown fox" for i in range(rows)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    with LLM(cpu_packed_gemm=False, **kw) as plain:
        assert plain.engine.runner.packed_weight_bytes == 0
        want = plain.generate(prompts, sp)
    with LLM(**kw) as packed:
        assert packed.engine.runner.packed_weight_bytes > 0
        linear, hits = cpu_ops.linear, []
        monkeypatch.setattr(cpu_ops, "linear", lambda x, w, b=None: hits.append(
            cpu_ops._packed_copy(x, w) is not None) or linear(x, w, b))
        got = packed.generate(prompts, sp)
    assert any(hits)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, rel=1e-4, abs=1e-4)


def test_weights_not_packed_when_memory_is_short(tiny_text_model, monkeypatch):
    from backend.model import host_memory
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1 << 20)  # 1 MiB left
    with LLM(model=str(tiny_text_model), num_kv_blocks=64, block_size=8, max_num_seqs=40) as llm:
        assert llm.engine.runner.packed_weight_bytes == 0
        assert llm.generate("Hello", SamplingParams(max_tokens=2)).pop().token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_screening_gives_the_full_heads_tokens(tiny_text_model, dtype):
    """Greedy-only steps read the lm_head's int8 copy and recompute only the rows that can win
    (backend/model/greedy_head.py): the same tokens as the full head (float32, or bf16's
    rounded logits, ties and all), batched, with speculation's verify rows, and beside requests
    that need every logit (which turn it off for their steps, with the same results as without
    it). bf16 screens the batches its GEMV takes (2 rows)."""
    kw = dict(model=str(tiny_text_model), num_kv_blocks=256, block_size=8, dtype=dtype)
    prompts = ["The quick brown fox", "Once upon a time there", "1 2 3 4 1 2 3 4 1 2"]
    if dtype == "bfloat16":
        prompts = [prompts[0], prompts[2]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    logprobs = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)

    def run(**extra):
        with LLM(**kw, **extra) as llm:
            outs = llm.generate(prompts, greedy) + llm.generate(
                prompts, [greedy, logprobs, greedy][:len(prompts)])
            return [(o.token_ids, o.cumulative_logprob) for o in outs], \
                llm.engine.runner.model.lm_head.screen

    want, off = run(greedy_screening=False)
    assert off is None
    got, screen = run()
    if screen is None:
        not_in_portable_build("greedy screening (bf16 GEMV)")
    assert got == want
    assert screen.rows >= len(prompts) * 11 and screen.candidates >= screen.rows
    spec, screen = run(speculative_ngram=3)
    assert [t for t, _ in spec] == [t for t, _ in want] and screen.rows > 0
