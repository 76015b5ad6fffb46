"""Embeddings (backend/engine/pooling.py): the engine's pooled vectors against transformers'
last_hidden_state pooled as sentence-transformers pools it, float32, 1e-4."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from backend import LLM
from backend.engine.sampling.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_checkpoint

ENGINE = dict(num_threads=2, max_num_batched_tokens=32, max_num_seqs=8, block_size=8,
              num_kv_blocks=96)
TEXTS = ["Hello world, this is a test of embeddings.", "short",
         "The quick brown fox jumps over the lazy dog. " * 6]  # chunked: over 32 tokens
ST_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
            "cls": "pooling_mode_cls_token"}


@pytest.fixture(scope="module")
def base(tmp_path_factory, default_model_dir) -> Path:
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("emb_qwen3"),
                                tokenizer_dir=default_model_dir)


@pytest.fixture(scope="module")
def hf_base(base):
    from transformers import AutoModel, AutoTokenizer
    return AutoModel.from_pretrained(base, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(base)


def reference(hf, text: str | list[int], method: str, normalize: bool,
              dimensions: int | None = None) -> torch.Tensor:
    """transformers' last_hidden_state, pooled as sentence-transformers' Pooling (and
    Normalize) modules do; `dimensions`: the first d values, renormalized (vLLM)."""
    model, tok = hf
    ids = torch.tensor([tok(text)["input_ids"] if isinstance(text, str) else text])
    with torch.no_grad():
        h = model(input_ids=ids).last_hidden_state[0]
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[method]
    if dimensions is not None:
        v = v[:dimensions]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def with_st_pooling(src: Path, dst: Path, method: str, normalize: bool) -> Path:
    """A copy of checkpoint src with sentence-transformers' modules.json and pooling config."""
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    cfg = {"word_embedding_dimension": 96, **{m: m == ST_MODES[method] for m in ST_MODES.values()}}
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooled_like_sentence_transformers(base, hf_base, tmp_path, method, normalize):
    model = with_st_pooling(base, tmp_path / "st", method, normalize)
    with LLM(model=str(model), **ENGINE, warmup=False) as llm:
        outs = llm.embed(TEXTS)
        again = llm.embed(TEXTS[2])[0]  # its prefix is cached now (taken by last-token only)
    for text, out in zip(TEXTS, outs):
        want = reference(hf_base, text, method, normalize)
        assert torch.allclose(torch.tensor(out.embedding), want, atol=1e-4, rtol=0)
        assert out.num_input_tokens == len(hf_base[1](text)["input_ids"])
    assert (again.num_cached_tokens > 0) == (method == "last")
    assert torch.allclose(torch.tensor(again.embedding), torch.tensor(outs[2].embedding),
                          atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def llm(base):
    """Default pooling (no modules.json: last token, normalized)."""
    with LLM(model=str(base), **ENGINE) as engine:
        yield engine


def test_default_is_last_token_normalized_and_takes_token_ids(llm, hf_base):
    ids = hf_base[1](TEXTS[0])["input_ids"]
    out = llm.embed([TEXTS[0], ids])
    want = reference(hf_base, TEXTS[0], "last", True)
    for o in out:
        assert torch.allclose(torch.tensor(o.embedding), want, atol=1e-4, rtol=0)


def test_dimensions_keep_the_first_values_renormalized(llm, hf_base):
    out = llm.embed(TEXTS[1], dimensions=16)[0]
    assert len(out.embedding) == 16
    want = reference(hf_base, TEXTS[1], "last", True, dimensions=16)
    assert torch.allclose(torch.tensor(out.embedding), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("bad", [0, 97, -1, 2.5, True])
def test_dimensions_out_of_range_are_refused(llm, bad):
    with pytest.raises(ValueError, match=r"^dimensions: must be an integer in \[1, 96\]"):
        llm.engine.prepare_embedding("x", "hi", bad)


def test_embeddings_share_batches_with_generation(llm, hf_base):
    """Generation and embedding requests in the same steps: the greedy tokens are those of the
    request alone, the vector transformers'."""
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(TEXTS[0], greedy)[0].token_ids
    engine.add_request("gen", engine.prepare_request("gen", TEXTS[0], greedy))
    engine.step()  # the generation is decoding when the long embedding's chunks arrive
    engine.add_request("emb", engine.prepare_embedding("emb", TEXTS[2]))
    tokens, vector, mixed = [], None, 0
    while engine.has_unfinished():
        outs = engine.step()
        mixed += len(outs) > 1
        for o in outs:
            if o.request_id == "gen":
                tokens += o.token_ids
            else:
                vector = o.embedding
    assert tokens[-len(alone) + 1:] == alone[1:] and vector is not None
    assert mixed and llm.stats["cold_path"] == {}  # warmed shapes: embeddings add none
    assert torch.allclose(torch.tensor(vector), reference(hf_base, TEXTS[2], "last", True),
                          atol=1e-4, rtol=0)
    assert engine.kv.num_used_blocks == 0


def test_embedding_only_checkpoint(base, hf_base, tmp_path):
    """A base-model checkpoint (no lm_head, its tensors without the `model.` prefix) embeds;
    a generate request gets a clear error."""
    out_dir = tmp_path / "base_only"
    hf_base[0].save_pretrained(out_dir, safe_serialization=True)
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (out_dir / "config.json").write_text(json.dumps(cfg))
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out_dir / f.name)
    with LLM(model=str(out_dir), **ENGINE, warmup=False) as only:
        got = only.embed(TEXTS[0])[0].embedding
        with pytest.raises(ValueError, match="only embeds"):
            only.generate(TEXTS[0])
    assert torch.allclose(torch.tensor(got), reference(hf_base, TEXTS[0], "last", True),
                          atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3", "phi3"])
def test_families_embed_like_transformers(arch, tmp_path, default_model_dir):
    from transformers import AutoModel, AutoTokenizer
    d = make_tiny_checkpoint(arch, tmp_path / arch, tokenizer_dir=default_model_dir)
    hf = (AutoModel.from_pretrained(d, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(d))
    with LLM(model=str(d), **ENGINE, pooling="mean", warmup=False) as llm:
        got = llm.embed(TEXTS[2])[0].embedding
    assert torch.allclose(torch.tensor(got), reference(hf, TEXTS[2], "mean", True),
                          atol=1e-4, rtol=0)


def test_tensor_parallel_embeddings_equal_one_rank(base, llm):
    with LLM(model=str(base), tensor_parallel_size=2, **dict(ENGINE, num_threads=1),
             warmup=False) as tp:
        got = tp.embed(TEXTS)
    for a, b in zip(got, llm.embed(TEXTS)):
        assert torch.allclose(torch.tensor(a.embedding), torch.tensor(b.embedding), atol=1e-5,
                              rtol=0)
