"""What a request asks its output to match (structured output), validated and made canonical.

Pure Python, no xgrammar: SamplingParams.validate() calls guided_spec() so a malformed constraint
fails when the request is made, with a ValueError naming the client's field. The canonical text is
the compile cache's key, so the same schema written with other spacing compiles once (key order
is kept: properties are generated in the schema's order).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from backend.engine import json_input

# The SamplingParams fields that constrain the output (vLLM's names); at most one may be set.
CONSTRAINT_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "response_format")
MAX_CONSTRAINT_CHARS = 1 << 20  # a schema or grammar larger than 1 MiB is refused outright
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class GuidedSpec:
    field: str  # the SamplingParams field it came from (named in errors)
    kind: str  # "json" (a schema), "json_object" (any JSON value), "regex", "grammar" (EBNF)
    text: str  # canonical: the schema as compact JSON, the regex, the grammar


def guided_spec(params) -> GuidedSpec | None:
    """The one constraint of ``params`` (a SamplingParams), or None; ValueError names the field."""
    given = [f for f in CONSTRAINT_FIELDS if getattr(params, f, None) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"{given[1]}: only one of {', '.join(CONSTRAINT_FIELDS)} may be set "
                         f"(also got {given[0]})")
    name = given[0]
    spec = _PARSERS[name](name, getattr(params, name))
    if spec is not None and len(spec.text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{name}: at most {MAX_CONSTRAINT_CHARS} characters")
    return spec


def _schema(name: str, v) -> GuidedSpec:
    if isinstance(v, (str, bytes)):
        v = json_input.loads(name, v)
    if not isinstance(v, dict):
        raise ValueError(f"{name}: must be a JSON schema object, got {type(v).__name__}")
    json_input.check_depth(name, v)  # json.dumps below recurses per level
    try:
        # Key order is kept: it is the order the properties are generated in.
        text = json.dumps(v, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: not representable as JSON ({e})") from None
    return GuidedSpec(name, "json", text)


def _nonempty_str(name: str, v) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{name}: must be a string, got {type(v).__name__}")
    if not v:
        raise ValueError(f"{name}: must not be empty")
    return v


def _regex(name: str, v) -> GuidedSpec:
    return GuidedSpec(name, "regex", _nonempty_str(name, v))


def _grammar(name: str, v) -> GuidedSpec:
    return GuidedSpec(name, "grammar", _nonempty_str(name, v))


def _choice(name: str, v) -> GuidedSpec:
    if not isinstance(v, (list, tuple)) or not all(isinstance(c, str) for c in v):
        raise ValueError(f"{name}: must be a list of strings")
    if not v:
        raise ValueError(f"{name}: must not be empty")
    if not all(v):
        raise ValueError(f"{name}: empty strings are not allowed")
    # An EBNF alternation of string literals; JSON string escaping is the EBNF literal's escaping.
    alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(v))
    return GuidedSpec(name, "grammar", f"root ::= {alts}")


def _response_format(name: str, v) -> GuidedSpec | None:
    """OpenAI's response_format: {"type": "json_object"}, {"type": "json_schema", "json_schema":
    {"schema": {...}}} or {"type": "text"} (no constraint)."""
    if isinstance(v, (str, bytes)):
        v = json_input.loads(name, v)
    if not isinstance(v, dict) or v.get("type") not in RESPONSE_FORMAT_TYPES:
        raise ValueError(f'{name}: must be an object whose "type" is one of '
                         f"{', '.join(RESPONSE_FORMAT_TYPES)}")
    if v["type"] == "text":
        return None
    if v["type"] == "json_object":
        return GuidedSpec(name, "json_object", "")
    inner = v.get("json_schema")
    if not isinstance(inner, dict) or "schema" not in inner:
        raise ValueError(f'{name}: type "json_schema" needs "json_schema": {{"schema": {{...}}}}')
    return GuidedSpec(name, "json", _schema(name, inner["schema"]).text)


_PARSERS = {"guided_json": _schema, "guided_regex": _regex, "guided_choice": _choice,
            "guided_grammar": _grammar, "response_format": _response_format}
