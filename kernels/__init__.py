"""Kernel dispatch: the one place that decides the device path.

CPU tensors take the torch reference implementations; CUDA kernels (OpenAI Triton) are chosen
here too once registered, so model code never branches on the device.
"""
from kernels import reference as ops

__all__ = ["ops"]
