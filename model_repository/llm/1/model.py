"""Triton loads this file; the model lives in the installed `backend` package (backend/triton/)."""
from backend.triton.adapter import TritonLLMModel as TritonPythonModel  # noqa: F401
