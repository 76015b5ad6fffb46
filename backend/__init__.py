"""Tensor-parallel LLM serving backend for Triton Inference Server.

Offline use: ``from backend import LLM, SamplingParams``.
"""
from backend.engine.async_engine import AsyncEngine, RequestStream
from backend.engine.config import EngineConfig
from backend.engine.llm import LLM
from backend.engine.llm_engine import LLMEngine
from backend.engine.outputs import CompletionOutput, RequestOutput
from backend.engine.sampling.sampling_params import SamplingParams
from backend.model.errors import ModelLoadError

__all__ = ["AsyncEngine", "CompletionOutput", "EngineConfig", "LLM", "LLMEngine",
           "ModelLoadError", "RequestOutput", "RequestStream", "SamplingParams"]
