from __future__ import annotations

import os

import pytest

# Tests run on a 2-core shared machine; spinning OpenMP threads starve each other.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Without CUDA, Triton's interpreter on from the start, whatever a test module imports first
import tests.triton_env  # noqa: E402,F401

# Engines on the real model in tests: a small KV pool and step budget keep warmup short.
SMALL_ENGINE = dict(kv_cache_memory_gb=0.1, max_num_batched_tokens=256, max_num_seqs=16)


@pytest.fixture(scope="session")
def default_model_dir():
    from backend.model.gguf_import import default_model_dir
    return default_model_dir()


@pytest.fixture(scope="session")
def smollm(default_model_dir):
    """One engine on the real default model, shared by the tests that only generate."""
    from backend import LLM
    return LLM(model=str(default_model_dir), num_threads=2, **SMALL_ENGINE)


@pytest.fixture(scope="session")
def hf_smollm(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory, default_model_dir):
    """A tiny random Qwen2 (qkv bias, GQA) with the default model's tokenizer: fast engine tests."""
    from tests.tiny_models import make_tiny_checkpoint
    return make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny_qwen2"),
                                tokenizer_dir=default_model_dir)
