"""vLLM-backend request fields that need more than a type conversion (pure functions).

- `seed`: the OpenAI schema and vLLM take any int64; the engine's generator takes [0, 2^64).
- `structured_outputs` (Triton's OpenAI frontend from 25.11, vLLM's StructuredOutputsParams) and
  `guided_decoding` (frontends 25.05-25.10 and vllm_backend clients, vLLM's GuidedDecodingParams):
  one dict (or its JSON text: the frontend sends json.dumps(asdict(params))) -> our guided_* fields.
Every error is a ValueError whose message starts with the name the client used.
"""
from __future__ import annotations

from backend.engine import json_input

SEED_MIN, SEED_END = -(2**63), 2**64


def seed_value(name: str, v: int) -> int:
    """Any int64 (or uint64) -> the engine's seed range [0, 2^64): a negative seed becomes the
    same 64 bits read as unsigned (s + 2^64; -1 -> 2^64 - 1), so each int64 has its own stream
    and the mapping never changes."""
    if not SEED_MIN <= v < SEED_END:
        raise ValueError(f"{name}: must be a 64-bit integer (in [-2^63, 2^64)), got {v}")
    return v + 2**64 if v < 0 else v


# structured-output key -> our SamplingParams field
STRUCTURED_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                   "grammar": "guided_grammar"}
# Keys that tune how vLLM compiles a constraint, not what it allows: ignored. asdict() also
# carries the private `_backend` / `_backend_was_auto` fields.
_TUNING = {"backend", "_backend", "backend_was_auto", "_backend_was_auto", "whitespace_pattern"}


def structured_fields(name: str, v) -> dict:
    """A `structured_outputs` / `guided_decoding` value -> {SamplingParams field: value}.
    Nulls, false flags and tuning keys are ignored; a constraint we cannot honour
    (`structural_tag`, or a key we do not know) is an error naming it."""
    if isinstance(v, (bytes, str)):
        text = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
        if not text.strip():
            return {}
        v = json_input.loads(name, text)
    else:
        json_input.check_depth(name, v)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ValueError(f"{name}: must be an object (vLLM's structured-output parameters)")
    out: dict = {}
    given: list[str] = []
    for key, val in v.items():
        if val is None or key in _TUNING or key.startswith("disable_"):
            continue
        if key == "json" and isinstance(val, str):  # the frontend sends the schema as text
            val = json_input.loads(f"{name}.json", val)
        if key in STRUCTURED_KEYS:
            out[STRUCTURED_KEYS[key]] = val
            given.append(key)
        elif key == "json_object":
            if val is True:
                out["response_format"] = {"type": "json_object"}
                given.append(key)
            elif val is not False:
                raise ValueError(f"{name}.json_object: must be true or false, got {val!r}")
        elif key == "structural_tag":
            raise ValueError(f"{name}.structural_tag: not supported by this backend (use json, "
                             "regex, choice, grammar or json_object)")
        else:
            raise ValueError(f"{name}.{key}: unknown structured-output key")
    if len(given) > 1:
        raise ValueError(f"{name}: give one constraint, got {', '.join(given)}")
    return out
