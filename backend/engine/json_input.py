"""Bounded JSON input: a client's JSON is parsed only after its size and nesting depth are checked.

Why: `json.loads` recurses once per nesting level, so `[[[[...]]]]` 10,000 levels deep raises
RecursionError (not a ValueError) from deep inside the parser, and `json.dumps` does the same on
an object that deep. Every request field must instead end in a ValueError that names the field.
So the depth of JSON text is measured first by a linear scan (no recursion, no parse), and an
object that did not come from our parser (a caller's dict) is measured by an iterative walk.

The limits are far above any real request (a JSON schema or a chat is a few levels deep) and
bound what one request can make the server allocate. This lives in the engine package because
both the engine (structured-output specs, backend/engine/sampling/guided_spec.py) and the Triton adapter
(backend/triton/request.py) read client JSON, and the adapter may import the engine, not back.
"""
from __future__ import annotations

import json
import re

import numpy as np

MAX_JSON_DEPTH = 64  # nesting levels of arrays and objects
MAX_JSON_CHARS = 4 << 20  # characters of JSON text (a structured-output schema is <= 1 MiB)

# A JSON string token, or an unterminated one running to the end of the text. It never fails to
# match where it starts, so stripping strings is one linear pass (a pattern that could fail at
# the end would be retried from every later quote: quadratic on `"\"\"\"...`).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON `text`, without parsing it.

    For valid JSON this is the exact depth. For invalid JSON it is at least the depth a parser
    reaches before it stops at the first error (up to that point both see the same strings and
    brackets), so a text that passes never makes the parser recurse deeper."""
    if "[" not in text and "{" not in text:
        return 0
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    b = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    steps = np.where((b == ord("[")) | (b == ord("{")), 1, -1).astype(np.int32)
    return int(max(np.cumsum(steps).max(), 0))


def loads(name: str, text: str | bytes, max_chars: int = MAX_JSON_CHARS,
          max_depth: int = MAX_JSON_DEPTH):
    """`json.loads(text)` for client input `name`; every failure is a ValueError naming it."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name}: not valid UTF-8") from None
    if len(text) > max_chars:
        raise ValueError(f"{name}: at most {max_chars} characters of JSON, got {len(text)}")
    # cheap first: text with no more opening brackets than the limit cannot nest deeper
    if text.count("[") + text.count("{") > max_depth and json_depth(text) > max_depth:
        raise ValueError(f"{name}: nested deeper than {max_depth}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: not valid JSON ({e.msg} at char {e.pos})") from None
    except ValueError:  # an integer literal longer than Python converts (4,300 digits)
        raise ValueError(f"{name}: not valid JSON (a number with too many digits)") from None


def check_depth(name: str, obj: object, max_depth: int = MAX_JSON_DEPTH) -> None:
    """ValueError when lists/tuples/dicts in `obj` nest deeper than `max_depth` (a cycle counts
    as too deep). Iterative; each container is expanded once, so objects shared along several
    paths cost no more than one copy."""
    heights: dict[int, int] = {}  # id -> height of a finished container
    if not isinstance(obj, (list, tuple, dict)):
        return
    # frames: [container, iterator over its children, tallest child so far]
    stack: list[list] = [[obj, iter(_children(obj)), 0]]
    while stack:
        frame = stack[-1]
        child = next(frame[1], _END)
        if child is _END:
            stack.pop()
            height = frame[2] + 1
            heights[id(frame[0])] = height
            if stack:
                stack[-1][2] = max(stack[-1][2], height)
            continue
        if not isinstance(child, (list, tuple, dict)):
            continue
        known = heights.get(id(child))
        if known is not None:
            if len(stack) + known > max_depth:
                raise ValueError(f"{name}: nested deeper than {max_depth}")
            frame[2] = max(frame[2], known)
            continue
        if len(stack) >= max_depth:
            raise ValueError(f"{name}: nested deeper than {max_depth}")
        stack.append([child, iter(_children(child)), 0])


_END = object()


def _children(obj):
    return obj.values() if isinstance(obj, dict) else obj
