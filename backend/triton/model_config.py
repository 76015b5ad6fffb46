"""config.pbtxt `parameters` -> engine settings and adapter options (pure: plain dicts in/out).

Every parameter is a string (Triton's `string_value`); empty means "use the default". A value
"${NAME}" is the environment variable NAME of the server (the Python-backend stub inherits it),
"${NAME:-text}" the same with `text` when NAME is unset or empty, so one config.pbtxt serves pods
that differ only in their environment (deploy/kubernetes/); an unset "${NAME}" means the default,
as an unfilled template does. A bad value is a load error naming the parameter.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

# parameter name -> (type, EngineConfig field)
ENGINE_PARAMETERS: dict[str, tuple[type, str]] = {
    "model": (str, "model"),
    "dtype": (str, "dtype"),
    "tensor_parallel_size": (int, "tensor_parallel_size"),
    "num_threads": (int, "num_threads"),
    "block_size": (int, "block_size"),
    "num_kv_blocks": (int, "num_kv_blocks"),
    "kv_cache_memory_gb": (float, "kv_cache_memory_gb"),
    "max_num_seqs": (int, "max_num_seqs"),
    "max_num_batched_tokens": (int, "max_num_batched_tokens"),
    "step_overhead_tokens": (int, "step_overhead_tokens"),
    "max_model_len": (int, "max_model_len"),
    "seed": (int, "seed"),
    "warmup": (bool, "warmup"),
    "device": (str, "device"),  # usually set by the instance kind (placement.engine_device)
    "cuda_graphs": (bool, "cuda_graphs"),
    "cpu_packed_gemm": (bool, "cpu_packed_gemm"),
    "greedy_screening": (bool, "greedy_screening"),
    "enable_prefix_caching": (bool, "enable_prefix_caching"),
    "speculative_ngram": (int, "speculative_ngram"),
    "speculative_ngram_match": (int, "speculative_ngram_match"),
    "pooling": (str, "pooling"),  # embeddings: last | mean | cls ("" = the checkpoint's)
    # TP across hosts (docs/parallelism.md): the other hosts run `python -m backend.parallel.node`
    "tp_local_ranks": (int, "tp_local_ranks"),
    "tp_master_addr": (str, "tp_master_addr"),
    "tp_master_port": (int, "tp_master_port"),
    "tp_collective_timeout_s": (float, "tp_collective_timeout_s"),
    # LoRA (vLLM backend's names); the adapters: multi_lora.json in the version folder
    "enable_lora": (bool, "enable_lora"),
    "max_loras": (int, "max_loras"),
    "max_lora_rank": (int, "max_lora_rank"),
    "max_cpu_loras": (int, "max_cpu_loras"),
}
ADAPTER_PARAMETERS = {"gpu_device_ids": str, "enable_metrics": bool, "vllm_metrics": bool,
                      "log_level": str}


@dataclass
class AdapterOptions:
    gpu_device_ids: str = ""
    enable_metrics: bool = True
    vllm_metrics: bool = True  # the vllm:* families beside llm_* (vllm_metrics.py)
    log_level: str = "INFO"


_FROM_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?\}", re.DOTALL)


def _expand(s: str, env: Mapping[str, str]) -> str:
    """A whole-value "${NAME}" / "${NAME:-text}" read from `env`; any other value as it is."""
    m = _FROM_ENV.fullmatch(s)
    if m is None:
        return s
    return (env.get(m.group(1)) or "").strip() or (m.group(2) or "").strip()


def parameter_values(model_config: dict, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """{name: string value} of the set parameters ("${NAME}" values read from `env`, default
    os.environ; empty values dropped)."""
    env = os.environ if env is None else env
    out = {}
    for name, v in (model_config.get("parameters") or {}).items():
        s = v.get("string_value", "") if isinstance(v, dict) else str(v)
        s = _expand(s.strip(), env)
        if s and not (s.startswith("${") and s.endswith("}")):
            out[name] = s
    return out


def _convert(name: str, typ: type, s: str):
    try:
        if typ is bool:
            low = s.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        return typ(s)
    except ValueError:
        kind = {int: "an integer", float: "a number", bool: "true or false"}.get(typ, typ.__name__)
        raise ValueError(f"parameter {name}: must be {kind}, got {s!r}") from None


def parse_parameters(model_config: dict, env: Mapping[str, str] | None = None
                     ) -> tuple[dict, AdapterOptions]:
    """(EngineConfig keyword arguments, AdapterOptions). Unknown parameters are errors, so a typo
    in config.pbtxt does not silently fall back to a default."""
    engine_kwargs: dict = {}
    opts = AdapterOptions()
    for name, s in parameter_values(model_config, env).items():
        if name in ENGINE_PARAMETERS:
            typ, field = ENGINE_PARAMETERS[name]
            engine_kwargs[field] = _convert(name, typ, s)
        elif name in ADAPTER_PARAMETERS:
            setattr(opts, name, _convert(name, ADAPTER_PARAMETERS[name], s))
        else:
            known = ", ".join(sorted([*ENGINE_PARAMETERS, *ADAPTER_PARAMETERS]))
            raise ValueError(f"parameter {name}: unknown; known parameters: {known}")
    return engine_kwargs, opts


def check_transaction_policy(model_config: dict) -> None:
    policy = model_config.get("model_transaction_policy") or {}
    if not policy.get("decoupled", False):
        raise ValueError("model_transaction_policy: this model streams its output and needs "
                         "`model_transaction_policy { decoupled: true }` in config.pbtxt")
