"""The Triton kernel namespace: the same function names and signatures as tpllm_kernels.reference.

Imported only when chosen (tpllm_kernels.select_ops), so the CPU path never loads Triton.
write_kv stays torch's index_copy_: one memory-bound copy that already runs as a single CUDA
kernel per tensor and is capturable in CUDA graphs; linear stays cuBLAS.
"""
# q/k norms, GeGLU and the final soft cap run as torch ops on the GPU: a few elementwise
# passes per layer, captured with the rest of a decode step in its CUDA graph
from tpllm_kernels.reference import gelu_tanh_mul, linear, qk_norm_, soft_cap, write_kv
from tpllm_kernels.triton_activation import silu_mul
from tpllm_kernels.triton_attention import (decode_attention, prefill_attention,
                                            prefill_attention_varlen)
from tpllm_kernels.triton_norm import add_rms_norm, rms_norm
from tpllm_kernels.triton_rotary import rotary

NAME = "triton"


def rotary_write_kv(qkv, cos, sin, num_q, num_kv, k_cache, v_cache, slot_mapping):
    """Same contract as tpllm_kernels.reference.rotary_write_kv, with the Triton rotary (in
    place)."""
    t, d = qkv.shape[0], cos.shape[-1]
    qk = rotary(qkv[:, :(num_q + num_kv) * d].view(t, num_q + num_kv, d), cos, sin)
    v = qkv[:, (num_q + num_kv) * d:].view(t, num_kv, d)
    write_kv(qk[:, num_q:], v, k_cache, v_cache, slot_mapping)
    return qk[:, :num_q], qk[:, num_q:], v

__all__ = ["linear", "rms_norm", "add_rms_norm", "silu_mul", "gelu_tanh_mul", "qk_norm_",
           "soft_cap", "rotary", "rotary_write_kv", "write_kv",
           "decode_attention",
           "prefill_attention", "prefill_attention_varlen"]
