"""The `vllm` Python-based backend: Triton loads <backend-directory>/vllm/model.py for every model
whose config says `backend: "vllm"` (and ignores the model's own 1/model.py). Triton's OpenAI
frontend allows logprobs only for models whose config names that backend, so this makes our
model qualify; the model itself is the same one model_repository/llm/1/model.py serves."""
from backend.triton.adapter import TritonLLMModel as TritonPythonModel  # noqa: F401
