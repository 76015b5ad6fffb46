"""Structured output on the real SmolLM2: JSON schemas (jsonschema is the judge), regex, choice,
EBNF grammar, json_object; constrained rows leave unconstrained ones alone; a request waits for
its grammar without holding anyone else; bad constraints fail alone, naming their field."""
from __future__ import annotations

import ast
import json
import re
import threading

import jsonschema
import numpy as np
import pytest
import torch

from backend import SamplingParams
from backend.engine.sampling import guided as guided_mod
from backend.triton.request import parse_request
from tests.guided_schemas import SCHEMAS

SEEDS = (None, 1, 2)  # None: greedy


def _chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)


def _params(seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0 if seed is None else 0.8, seed=seed, **kw)


def _run_engine(engine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    """Add the requests, step until all finish; request id -> (text, token ids, final output)."""
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
    res = {rid: ["", []] for rid in requests}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            res[out.request_id][0] += out.text
            res[out.request_id][1] += out.token_ids
            if out.finished:
                final[out.request_id] = out
    return {rid: (t, ids, final[rid]) for rid, (t, ids) in res.items()}


def test_json_schemas_validate_greedy_and_sampled(smollm):
    assert len(SCHEMAS) >= 20
    prompts, params = [], []
    for desc, schema in SCHEMAS:
        for seed in SEEDS:
            prompts.append(_chat(smollm, f"Reply with JSON only: {desc}."))
            params.append(_params(seed, max_tokens=96, guided_json=schema))
    outs = smollm.generate(prompts, params)
    bad = []
    for (desc, schema), i in zip(SCHEMAS, range(0, len(outs), len(SEEDS))):
        for seed, out in zip(SEEDS, outs[i:i + len(SEEDS)]):
            try:
                assert out.finish_reason == "stop", out.finish_reason
                jsonschema.validate(json.loads(out.text), schema)
            except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                bad.append((desc, seed, out.text, str(e)[:200]))
    assert not bad, bad
    assert smollm.stats["cold_path"] == {}


REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(cat|dog|bird)s?", r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}",
           r"#[0-9a-f]{6}", r"(yes|no), because [a-z ]{5,20}\."]


def test_regex_choice_grammar_and_json_object(smollm):
    choices = ["positive", "negative", "neutral"]
    # arithmetic expressions (bounded, so they end inside max_tokens): Python's parser judges
    grammar = ('root ::= expr\nexpr ::= term (op term){0,3}\nop ::= "+" | "-" | "*"\n'
               'term ::= num | "(" num (op num){1,2} ")"\nnum ::= [1-9] [0-9]{0,2}')
    cases = [(r, {"guided_regex": r}) for r in REGEXES]
    cases += [("choice", {"guided_choice": choices}), ("grammar", {"guided_grammar": grammar}),
              ("json_object", {"response_format": {"type": "json_object"}})]
    prompts, params = [], []
    for _, kw in cases:
        for seed in SEEDS:
            prompts.append(_chat(smollm, "Answer briefly: what do you think about cats?"))
            params.append(_params(seed, max_tokens=64, **kw))
    outs = smollm.generate(prompts, params)
    for (name, kw), i in zip(cases, range(0, len(outs), len(SEEDS))):
        for out in outs[i:i + len(SEEDS)]:
            assert out.finish_reason == "stop", (name, out.text)
            if "guided_regex" in kw:
                assert re.fullmatch(kw["guided_regex"], out.text), (name, out.text)
            elif name == "choice":
                assert out.text in choices
            elif name == "grammar":
                assert re.fullmatch(r"[0-9+\-*()]+", out.text), out.text
                ast.parse(out.text, mode="eval")
            else:
                assert isinstance(json.loads(out.text), dict), out.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab,rows,masked", [(49152, 1, [0]), (100, 3, [0, 1, 2]),
                                               (70, 4, [1, 3]), (33, 2, [1])])
def test_mask_logits_bans_exactly_the_cleared_bits(vocab, rows, masked, dtype):
    """The numpy mask (CPU) and the torch one (other devices, bfloat16) agree with a per-token
    reference: bit b of word w allows token 32 * w + b, bit 31 included; other rows untouched."""
    g = torch.Generator().manual_seed(vocab + rows)
    words = (vocab + 31) // 32
    allowed = torch.rand(len(masked), words * 32, generator=g) < 0.5
    allowed[:, -1] = True  # the sign bit of the last word (past the vocab where vocab % 32)
    if len(masked) > 1:
        allowed[1] = True  # a row that allows everything
    packed = np.packbits(allowed.numpy(), axis=-1, bitorder="little").view(np.int32)
    bitmasks = [torch.from_numpy(packed[j:j + 1].copy()) for j in range(len(masked))]
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    want = logits.clone()
    for j, i in enumerate(masked):
        want[i, ~allowed[j, :vocab]] = float("-inf")
    for fn in (guided_mod.mask_logits, guided_mod._mask_torch):
        got = logits.clone()
        fn(got, bitmasks, masked)
        assert torch.equal(got, want), fn.__name__


def test_constrained_rows_leave_unconstrained_rows_unchanged(smollm):
    free = [("The capital of France is", SamplingParams(temperature=0, max_tokens=24)),
            ("Once upon a time", SamplingParams(temperature=0.9, seed=7, max_tokens=24))]
    alone = _run_engine(smollm.engine, {f"alone{i}": r for i, r in enumerate(free)})
    mixed = {f"free{i}": r for i, r in enumerate(free)}
    mixed.update({f"json{i}": (_chat(smollm, "A person as JSON."), _params(
        seed, max_tokens=48, guided_json=SCHEMAS[0][1])) for i, seed in enumerate(SEEDS)})
    mixed["regex"] = ("Phone:", _params(None, max_tokens=16, guided_regex=REGEXES[0]))
    both = _run_engine(smollm.engine, mixed)
    for i in range(len(free)):
        assert both[f"free{i}"][1] == alone[f"alone{i}"][1]
        assert both[f"free{i}"][2].finish_reason == "length"


def test_max_tokens_caps_a_constrained_request(smollm):
    out = smollm.generate(_chat(smollm, "A person as JSON."),
                          _params(None, max_tokens=3, guided_json=SCHEMAS[0][1]))[0]
    assert out.finish_reason == "length" and out.num_output_tokens == 3
    assert out.text.startswith("{")


def test_grammar_is_compiled_once_per_distinct_constraint(smollm):
    cache = smollm.engine.guided.cache
    schema = {"type": "object", "properties": {"q": {"type": "integer", "minimum": 3,
                                                    "maximum": 7}}, "required": ["q"]}
    compiles0 = cache.compiles
    outs = smollm.generate(["Q:"] * 3, [_params(None, max_tokens=16, guided_json=schema),
                                       _params(1, max_tokens=16, guided_json=json.dumps(
                                           schema, indent=2)),  # same schema, other spacing
                                       _params(2, max_tokens=16, guided_json=schema)])
    assert cache.compiles == compiles0 + 1
    assert all(3 <= json.loads(o.text)["q"] <= 7 for o in outs)


def test_a_request_waits_for_its_grammar_without_holding_others(smollm, monkeypatch):
    """The compile is held on an Event: steps run by hand, no timing involved."""
    engine = smollm.engine
    release = threading.Event()
    compile_ = engine.guided.cache._compile

    def held(spec):
        release.wait()
        return compile_(spec)
    monkeypatch.setattr(engine.guided.cache, "_compile", held)
    prompt = _chat(smollm, "Pick a number as JSON.")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 40,
                                                    "maximum": 49}}, "required": ["n"]}
    engine.add_request("held", prompt, _params(None, max_tokens=16, guided_json=schema))
    engine.add_request("free", "Hello", SamplingParams(temperature=0, max_tokens=6))
    seq = engine.requests["held"]
    free_tokens = 0
    try:
        while "free" in engine.requests:
            for out in engine.step():
                assert out.request_id == "free"
                free_tokens += len(out.token_ids)
        assert free_tokens == 6
        assert seq.num_computed_tokens == seq.num_prompt_tokens - 1  # all but the last token
    finally:
        release.set()
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "held"
    assert seq.finish_reason == "stop"
    assert 40 <= json.loads(engine.tokenizer.decode(seq.output_token_ids,
                                                    skip_special_tokens=True))["n"] <= 49


BAD_SAMPLING = [
    (dict(guided_json="{not json"), "guided_json: not valid JSON"),
    (dict(guided_json=[1, 2]), "guided_json: must be a JSON schema object"),
    (dict(guided_regex=""), "guided_regex: must not be empty"),
    (dict(guided_choice=[]), "guided_choice: must not be empty"),
    (dict(guided_choice="yes"), "guided_choice: must be a list of strings"),
    (dict(guided_grammar=3), "guided_grammar: must be a string"),
    (dict(guided_regex="a", guided_choice=["a"]), "guided_choice: only one of"),
    (dict(response_format={"type": "xml"}), "response_format: must be an object"),
    (dict(response_format={"type": "json_schema"}), "response_format: type \"json_schema\""),
]


@pytest.mark.parametrize("kw,msg", BAD_SAMPLING)
def test_malformed_constraints_are_refused_naming_the_field(kw, msg):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert str(e.value).startswith(msg)


UNCOMPILABLE = [
    ("guided_json", {"type": "foo"}),
    ("guided_regex", "(ab"),
    ("guided_grammar", "root ::= undefined_rule"),
]


def test_uncompilable_constraints_fail_alone(smollm):
    reqs = {f"bad{i}": ("Hi", SamplingParams(temperature=0, max_tokens=8, **{f: v}))
            for i, (f, v) in enumerate(UNCOMPILABLE)}
    reqs["good"] = ("The capital of France is", SamplingParams(temperature=0, max_tokens=8,
                                                              top_logprobs=2))
    want = _run_engine(smollm.engine, {"ref": reqs["good"]})["ref"][1]
    chosen = []  # the good row's per-token logprobs stay its own beside the failures' outputs
    real_step = smollm.engine.step

    def step():
        outs = real_step()
        chosen.extend(p.chosen.token_id for o in outs if o.request_id == "good"
                      for p in o.logprobs or [])
        return outs
    smollm.engine.step = step
    try:
        res = _run_engine(smollm.engine, reqs)
    finally:
        del smollm.engine.step
    for i, (field, _) in enumerate(UNCOMPILABLE):
        text, ids, out = res[f"bad{i}"]
        assert (out.finish_reason, out.invalid, text, ids) == ("error", True, "", [])
        assert out.error.startswith(f"{field}: cannot be compiled for this model"), out.error
    assert res["good"][1] == want and res["good"][2].finish_reason == "length"
    assert chosen == want


def test_request_parsing_of_constraints():
    sp = json.dumps({"guided_json": {"type": "object"}, "max_tokens": 5})
    assert parse_request({"text_input": "x", "sampling_parameters": sp}).params.guided.kind == "json"
    p = parse_request({"text_input": "x"}, {"guided_choice": '["a", "b"]'}).params
    assert p.guided_choice == ["a", "b"]
    p = parse_request({"text_input": "x"}, {"guided_json": '{"type": "integer"}'}).params
    assert p.guided.text == '{"type": "integer"}'
    p = parse_request({"text_input": "x"}, {"response_format": '{"type": "json_object"}'}).params
    assert p.guided.kind == "json_object"
    for inputs, params, msg in [
            ({"sampling_parameters": json.dumps({"guided_choice": []})}, None,
             "sampling_parameters.guided_choice: must not be empty"),
            ({}, {"guided_json": "{bad"}, "guided_json: not valid JSON"),
            ({"sampling_parameters": json.dumps({"guided_regex": 5})}, None,
             "sampling_parameters.guided_regex: must be a string")]:
        with pytest.raises(ValueError) as e:
            parse_request({"text_input": "x", **inputs}, params)
        assert str(e.value).startswith(msg)
