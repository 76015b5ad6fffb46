"""The Triton kernel namespace: the same function names and signatures as kernels.reference.

Imported only when chosen (kernels.select_ops), so the CPU path never loads Triton.
write_kv stays torch's index_copy_: one memory-bound copy that already runs as a single CUDA
kernel per tensor and is capturable in CUDA graphs.
"""
from kernels.reference import write_kv
from kernels.triton_activation import silu_mul
from kernels.triton_attention import decode_attention, prefill_attention, prefill_attention_varlen
from kernels.triton_norm import add_rms_norm, rms_norm
from kernels.triton_rotary import rotary

NAME = "triton"

__all__ = ["rms_norm", "add_rms_norm", "silu_mul", "rotary", "write_kv", "decode_attention",
           "prefill_attention", "prefill_attention_varlen"]
