"""Triton request -> (prompt, SamplingParams, options): pure functions over plain values.

Three sources, most specific wins: input tensors > request parameters (HTTP generate's
`parameters`) > the `sampling_parameters` JSON object (vLLM-backend convention). Every error is a
ValueError whose message starts with the name the client used (e.g. "min_length: ...").
The contract and the defaults: model_repository/README.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from backend.engine import json_input
from backend.engine.sampling.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from backend.triton.embedding_request import FIELD as EMBEDDING_FIELD
from backend.triton.embedding_request import EmbeddingInput, parse_embedding_request
from backend.triton.vllm_compat import STRUCTURED_KEYS, seed_value, structured_fields

# client name -> (kind, target). Targets starting with "." are adapter options, others are
# SamplingParams fields. TensorRT-LLM names (min_length, random_seed, runtime_top_k/p) are aliases.
FIELDS: dict[str, tuple[str, str]] = {
    "max_tokens": ("int", "max_tokens"),
    "min_tokens": ("int", "min_tokens"),
    "min_length": ("int", "min_tokens"),
    "temperature": ("float", "temperature"),
    "top_k": ("int", "top_k"),
    "runtime_top_k": ("int", "top_k"),
    "top_p": ("float", "top_p"),
    "runtime_top_p": ("float", "top_p"),
    "min_p": ("float", "min_p"),
    "repetition_penalty": ("float", "repetition_penalty"),
    "presence_penalty": ("float", "presence_penalty"),
    "frequency_penalty": ("float", "frequency_penalty"),
    "seed": ("seed", "seed"),  # any int64 (vllm_compat.seed_value)
    "random_seed": ("seed", "seed"),
    "stop_words": ("strs", "stop"),
    "stop": ("strs", "stop"),
    "stop_token_ids": ("ints", "stop_token_ids"),
    "ignore_eos": ("bool", "ignore_eos"),
    "include_stop_str_in_output": ("bool", "include_stop_str_in_output"),
    "skip_special_tokens": ("bool", "skip_special_tokens"),
    # Structured output (vLLM's names); "json" values may also be given as JSON text.
    "guided_json": ("json", "guided_json"),
    "guided_regex": ("str", "guided_regex"),
    "guided_choice": ("json", "guided_choice"),
    "guided_grammar": ("str", "guided_grammar"),
    "response_format": ("json", "response_format"),
    # vLLM's structured-output dicts (the OpenAI frontend's named/required tool_choice)
    "structured_outputs": ("structured", ".structured"),
    "guided_decoding": ("structured", ".structured"),
    "beam_width": ("int", ".beam_width"),
    "n": ("int", "n"),  # parallel sampling: every output then has one element per sample
    "best_of": ("int", ".best_of"),  # older OpenAI frontends forward it (default 1)
    "stream": ("bool", ".stream"),
    "exclude_input_in_output": ("bool", ".exclude_input_in_output"),
    "chat": ("bool", ".chat"),
    "return_finish_reason": ("bool", ".return_finish_reason"),
    "return_num_input_tokens": ("bool", ".return_num_input_tokens"),
    "return_num_output_tokens": ("bool", ".return_num_output_tokens"),
    "return_cumulative_logprob": ("bool", ".return_cumulative_logprob"),
    # Per-token logprobs (the OpenAI frontend's vLLM contract): `return_logprobs` asks for the
    # `logprobs` output; `logprobs` (vLLM: k alternatives; a boolean counts as 0/1) or
    # `top_logprobs` (OpenAI's name) in sampling_parameters says how many alternatives.
    "return_logprobs": ("bool", ".return_logprobs"),
    "logprobs": ("count", "top_logprobs"),
    "top_logprobs": ("int", "top_logprobs"),
    "return_num_cached_tokens": ("bool", ".return_num_cached_tokens"),
    "lora_name": ("str", "lora_name"),  # a LoRA adapter of multi_lora.json (vLLM backend's name)
}
# Input tensors of config.pbtxt besides text_input / sampling_parameters (all optional).
TENSOR_INPUTS = ("max_tokens", "min_tokens", "min_length", "temperature", "top_k", "top_p",
                 "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                 "random_seed", "stop_words", "ignore_eos", "stream", "exclude_input_in_output",
                 "chat", "beam_width", "return_finish_reason", "return_num_input_tokens",
                 "return_num_output_tokens", "return_cumulative_logprob", "return_logprobs",
                 "return_num_cached_tokens")
ALL_INPUTS = ("text_input", "sampling_parameters", "embedding_request", *TENSOR_INPUTS)
RETURN_FIELDS = ("finish_reason", "num_input_tokens", "num_output_tokens", "cumulative_logprob",
                 "logprobs", "num_cached_tokens")


@dataclass
class ParsedRequest:
    prompt: str
    params: SamplingParams
    stream: bool = False
    # None = not given: the prompt is prepended to a non-streaming reply only (vLLM backend);
    # False (given) prepends it to a stream's first response too (OpenAI's echo).
    exclude_input_in_output: bool | None = None
    chat: bool = False
    messages: list | None = None
    # output name -> sent on every response (its return_* flag is true) or never (vLLM backend)
    returns: dict[str, bool] = field(default_factory=dict)
    embedding: EmbeddingInput | None = None  # an embedding request (embedding_request input)


def _one(name: str, v):
    """The single element of a tensor (shape [1] or [1, 1]); scalars pass through."""
    if isinstance(v, np.ndarray):
        if v.size != 1:
            raise ValueError(f"{name}: expected one value, got {v.size}")
        return v.reshape(-1)[0]
    if isinstance(v, (list, tuple)):
        if len(v) != 1:
            raise ValueError(f"{name}: expected one value, got {len(v)}")
        return v[0]
    return v


def _text(name: str, v) -> str:
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name}: not valid UTF-8") from None
    if isinstance(v, str):
        return v
    raise ValueError(f"{name}: must be a string, got {type(v).__name__}")


def convert(name: str, kind: str, v):
    """One client value -> the Python value of `kind`, or ValueError naming `name`."""
    if kind == "structured":
        return structured_fields(name, v if isinstance(v, (dict, list)) else _one(name, v))
    if kind in ("str", "json"):
        v = _text(name, _one(name, v)) if not isinstance(v, (dict, list)) else v
        if kind == "json":
            if isinstance(v, str):
                v = json_input.loads(name, v)
            else:  # already parsed (a caller's dict): the engine serializes it again
                json_input.check_depth(name, v)
        return v
    if kind == "strs":
        if isinstance(v, np.ndarray):
            v = v.reshape(-1).tolist()
        if isinstance(v, (bytes, str)):
            s = _text(name, v)
            if s.startswith("["):  # a JSON list given as one string (request parameters)
                try:
                    v = json_input.loads(name, s)
                except ValueError as e:
                    raise ValueError(f"{name}: not a valid JSON list of strings "
                                     f"({str(e).removeprefix(name + ': ')})") from None
            else:
                return [s] if s else []
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"{name}: must be a list of strings")
        return [s for s in (_text(name, x) for x in v) if s]  # TRT-LLM pads with ""
    if kind == "ints":
        if isinstance(v, np.ndarray):
            v = v.reshape(-1).tolist()
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"{name}: must be a list of integers")
        return [convert(name, "int", x) for x in v]
    v = _one(name, v)
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, bytes):
        v = _text(name, v)
    if kind == "count":  # an integer, or a boolean meaning 0 / 1 (vLLM's `logprobs`)
        if isinstance(v, bool):
            return int(v)
        kind = "int"
    if kind == "bool":
        if isinstance(v, bool):
            return v
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0"):
            return v.strip().lower() in ("true", "1")
        raise ValueError(f"{name}: must be a boolean (true or false), got {v!r}")
    if isinstance(v, bool):
        raise ValueError(f"{name}: must be a number, got {v!r}")
    if isinstance(v, str):
        try:
            v = float(v) if kind == "float" else int(v.strip())
        except ValueError:
            try:
                v = float(v)  # "16.0" for an integer field
            except ValueError:
                raise ValueError(f"{name}: must be a number, got {v!r}") from None
    if kind == "float":
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name}: must be a finite number, got {v!r}")
        return float(v)
    if isinstance(v, float):
        if not v.is_integer():
            raise ValueError(f"{name}: must be an integer, got {v!r}")
        v = int(v)
    if not isinstance(v, int):
        raise ValueError(f"{name}: must be an integer, got {v!r}")
    if kind == "seed":
        return seed_value(name, v)
    return v


def _sampling_json(v) -> dict:
    s = _text("sampling_parameters", _one("sampling_parameters", v))
    if not s.strip():
        return {}
    obj = json_input.loads("sampling_parameters", s)
    if not isinstance(obj, dict):
        raise ValueError("sampling_parameters: must be a JSON object")
    for k in obj:
        if k not in FIELDS:
            raise ValueError(f"sampling_parameters: unknown field {k!r}")
    return obj


def embedding_text(inputs: dict) -> str | None:
    """The embedding_request JSON text, when the request carries a non-empty one."""
    v = inputs.get(EMBEDDING_FIELD)
    if v is None:
        return None
    text = _text(EMBEDDING_FIELD, _one(EMBEDDING_FIELD, v))
    return text if text.strip() else None


def parse_embedding(inputs: dict, text: str) -> ParsedRequest:
    """An embedding request (vllm_backend's contract): its input and dimensions, and which of
    num_input_tokens / num_output_tokens to return; text_input may be absent or empty."""
    returns = {f: False for f in RETURN_FIELDS}
    for f in ("num_input_tokens", "num_output_tokens"):
        v = inputs.get(f"return_{f}")
        returns[f] = v is not None and convert(f"return_{f}", "bool", v)
    return ParsedRequest("", SamplingParams(), returns=returns,
                         embedding=parse_embedding_request(text))


def parse_request(inputs: dict, parameters: dict | str | None = None,
                  max_num_seqs: int | None = None) -> ParsedRequest:
    """`inputs`: input name -> numpy array (or plain value); `parameters`: the request parameters
    (a dict or its JSON text). Unknown request parameters are ignored (Triton shares them).
    `max_num_seqs`: the engine's, which bounds `n` (named as the client named it)."""
    if "text_input" not in inputs or inputs["text_input"] is None:
        raise ValueError("text_input: required")
    prompt = _text("text_input", _one("text_input", inputs["text_input"]))
    if isinstance(parameters, str):
        parameters = json_input.loads("parameters", parameters) if parameters.strip() else {}
    if parameters is not None and not isinstance(parameters, dict):
        raise ValueError("parameters: must be a JSON object")
    # values a direct caller passes already parsed: error messages quote them (repr recurses)
    json_input.check_depth("parameters", parameters)
    for k, v in inputs.items():
        json_input.check_depth(k, v)
    values: dict[str, tuple[str, object]] = {}  # target -> (client name, value)
    if inputs.get("sampling_parameters") is not None:
        for k, v in _sampling_json(inputs["sampling_parameters"]).items():
            if v is not None:
                name = f"sampling_parameters.{k}"
                kind = FIELDS[k][0]
                if isinstance(v, list) and kind not in ("strs", "ints", "json"):  # JSON, not a tensor
                    raise ValueError(f"{name}: must be a single value, not a list ({v!r})")
                if kind == "strs" and isinstance(v, str):
                    v = [v]  # a JSON string here is one stop string, never a JSON list in text
                values[FIELDS[k][1]] = (name, convert(name, kind, v))
    for k, v in (parameters or {}).items():
        if k in FIELDS:
            values[FIELDS[k][1]] = (k, convert(k, FIELDS[k][0], v))
    for k, v in inputs.items():
        if k in FIELDS and v is not None:
            values[FIELDS[k][1]] = (k, convert(k, FIELDS[k][0], v))
    opts = {t[1:]: val for t, (_, val) in values.items() if t.startswith(".")}
    kwargs = {t: val for t, (_, val) in values.items() if not t.startswith(".")}
    if opts.get("beam_width", 1) != 1:
        raise ValueError(f"{values['.beam_width'][0]}: only 1 is supported (no beam search; "
                         "for several samples of a prompt use n)")
    if opts.get("best_of", 1) != 1:  # vLLM's V1 engine refuses it too
        raise ValueError(f"{values['.best_of'][0]}: only 1 is supported (as in vLLM's V1 "
                         "engine); for several samples of a prompt use n")
    _merge_structured(values, kwargs, opts.pop("structured", None))
    returns = {f: bool(opts.get(f"return_{f}")) for f in RETURN_FIELDS}
    if returns["cumulative_logprob"]:
        kwargs["logprobs"] = True
    try:
        _resolve_top_logprobs(kwargs, bool(returns["logprobs"]))
        params = SamplingParams(**kwargs)
    except ValueError as e:  # the engine names its field; name it as the client did
        msg = str(e)
        target = msg.split(":", 1)[0]
        if target in values and values[target][0] != target:
            msg = values[target][0] + msg[len(target):]
        raise ValueError(msg) from None
    if max_num_seqs is not None and params.n > max_num_seqs:
        raise ValueError(f"{values['n'][0]}: at most max_num_seqs ({max_num_seqs}) samples run "
                         f"at once, got {params.n}")
    req = ParsedRequest(prompt, params, opts.get("stream", False),
                        opts.get("exclude_input_in_output"), opts.get("chat", False),
                        returns=returns)
    if req.chat:
        req.messages = parse_messages(prompt)
    return req


def _merge_structured(values: dict, kwargs: dict, fields: dict | None) -> None:
    """The guided_* fields a structured_outputs / guided_decoding dict maps to, unless the
    request also names a constraint directly (then it is an error: one constraint)."""
    if not fields:
        return
    name = values[".structured"][0]
    for target in (*STRUCTURED_KEYS.values(), "response_format"):
        if kwargs.get(target) is not None:
            raise ValueError(f"{name}: a constraint is also given as {values[target][0]}; "
                             "give one")
    for target, v in fields.items():
        kwargs[target] = v
        key = {f: k for k, f in STRUCTURED_KEYS.items()}.get(target, "json_object")
        values[target] = (f"{name}.{key}", v)


def _resolve_top_logprobs(kwargs: dict, returned: bool) -> None:
    """Per-token logprobs are computed only when the `logprobs` output is asked for (the vLLM
    backend's `return_logprobs`) and sampling_parameters names k (0 = the chosen token alone).
    Without k the output is JSON null, as vLLM's (its SamplingParams.logprobs is None). The value
    is checked either way, as vLLM refuses a `logprobs` above its maximum whatever is returned."""
    k = kwargs.get("top_logprobs")
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
    if not returned:
        kwargs.pop("top_logprobs", None)


# Chat messages are the prompt, so they may be longer than other JSON; a chat this long is far
# beyond any context (check_prompt_size then measures what is left) and bounds the parse.
MAX_CHAT_JSON_CHARS = 8 << 20


def parse_messages(text: str) -> list[dict]:
    """Chat mode: text_input is a JSON list of {"role", "content"} (or a plain string, taken as
    one user message)."""
    s = text.strip()
    if not s.startswith("["):
        return [{"role": "user", "content": text}]
    try:
        msgs = json_input.loads("text_input", s, max_chars=MAX_CHAT_JSON_CHARS)
    except ValueError as e:
        raise ValueError(f"text_input: chat messages: {str(e).removeprefix('text_input: ')}") \
            from None
    if not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                           and isinstance(m.get("content"), str) for m in msgs):
        raise ValueError('text_input: chat messages must be a non-empty JSON list of '
                         '{"role": "...", "content": "..."} objects')
    return msgs


def render_chat(tokenizer, messages: list[dict]) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat: this model has no chat template; send plain text_input")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:
        raise ValueError(f"text_input: the chat template rejected the messages ({e})") from None


# A prompt longer than this many characters per context token is measured on a prefix first
# (see check_prompt_size): normal text is 3-5 characters per token.
PREFIX_CHARS_PER_TOKEN = 8
_PREFIX_MARGIN_TOKENS = 64


def check_prompt_size(tokenizer, prompt: str, max_model_len: int) -> None:
    """Rejects a prompt that certainly exceeds the context without tokenizing all of it.

    The engine tokenizes the whole prompt before it compares the length with the context; for a
    10 MB prompt that is ~10 s of a core in the request path. Here a prompt of more than
    PREFIX_CHARS_PER_TOKEN * max_model_len characters is first tokenized up to that many
    characters (cut at whitespace): if that prefix alone already exceeds the context (with a
    margin for the word cut in two), the request is refused at once. Otherwise (text of unusually
    long tokens) the engine measures it exactly, as for any prompt."""
    limit = PREFIX_CHARS_PER_TOKEN * max_model_len
    if tokenizer is None or len(prompt) <= limit:
        return
    cut = prompt[:limit]
    space = max(cut.rfind(" "), cut.rfind("\n"))
    if space > limit // 2:
        cut = cut[:space]
    n = len(tokenizer.encode(cut))
    if n >= max_model_len + _PREFIX_MARGIN_TOKENS:
        raise ValueError(f"text_input: the prompt is longer than the context: its first {len(cut)} "
                         f"of {len(prompt)} characters are already {n} tokens; the context holds "
                         f"{max_model_len} (prompt + at least one generated token)")
