"""`python -m client generate "prompt"`: one request to the Triton server, tokens printed as they
arrive, usage and finish reason at the end (on stderr).

Also the small client library the chat command and the integration tests use:
`generate(fields, protocol, url, model, on_text)` over gRPC streaming (tritonclient) or HTTP
generate / generate_stream (stdlib http.client; server-sent events).
"""
from __future__ import annotations

import http.client
import json
import queue
import sys
import time
import uuid

import numpy as np

# input name -> Triton datatype (see model_repository/llm/config.pbtxt)
DTYPES = {"text_input": "BYTES", "sampling_parameters": "BYTES", "embedding_request": "BYTES",
          "stop_words": "BYTES",
          "seed": "UINT64", "random_seed": "UINT64"}
for _n in ("max_tokens", "min_tokens", "min_length", "top_k", "beam_width"):
    DTYPES[_n] = "INT32"
for _n in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty"):
    DTYPES[_n] = "FP32"
for _n in ("stream", "ignore_eos", "exclude_input_in_output", "chat", "return_finish_reason",
           "return_num_input_tokens", "return_num_output_tokens", "return_cumulative_logprob",
           "return_logprobs", "return_num_cached_tokens"):
    DTYPES[_n] = "BOOL"
NP = {"BYTES": np.object_, "UINT64": np.uint64, "INT32": np.int32, "FP32": np.float32,
      "BOOL": np.bool_}
OUTPUTS = ("finish_reason", "num_input_tokens", "num_output_tokens", "cumulative_logprob",
           "num_cached_tokens")
DEFAULT_URL = {"grpc": "localhost:8001", "http": "localhost:8000"}


class ServerError(RuntimeError):
    pass


def grpc_inputs(fields: dict):
    import tritonclient.grpc as grpcclient
    inputs = []
    for name, value in fields.items():
        dt = DTYPES[name]
        vals = value if isinstance(value, list) else [value]
        if dt == "BYTES":
            vals = [v.encode("utf-8") if isinstance(v, str) else v for v in vals]
        arr = np.array(vals, dtype=NP[dt])
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def _scalar(result, name):
    try:
        arr = result.as_numpy(name)
    except Exception:
        return None
    if arr is None or arr.size == 0:
        return None
    v = arr.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else v.item()


def generate_grpc(fields: dict, url: str, model: str, on_text=None, timeout: float = 600):
    """Streams one request over gRPC (decoupled models need the streaming API even when
    `stream` is false). Returns {"text", "finish_reason", "num_input_tokens", ...}."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    out: dict = {"text": "", "responses": 0}
    try:
        client.async_stream_infer(model, grpc_inputs(fields), request_id=uuid.uuid4().hex,
                                  enable_empty_final_response=True)
        while True:
            result, error = q.get(timeout=timeout)
            if error is not None:
                raise ServerError(str(error))
            resp = result.get_response()
            final = resp.parameters["triton_final_response"].bool_param
            text = _scalar(result, "text_output") if resp.outputs else None
            if text:
                out["text"] += text
                if on_text:
                    on_text(text)
            if resp.outputs:
                out["responses"] += 1
            for k in OUTPUTS:
                v = _scalar(result, k) if resp.outputs else None
                if v is not None:
                    _merge(out, k, v)
            if final:
                return out
    finally:
        client.stop_stream()
        client.close()


def generate_http(fields: dict, url: str, model: str, on_text=None, timeout: float = 600):
    """HTTP generate_stream when fields["stream"], else generate (exactly one response)."""
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port or 80), timeout=timeout)
    stream = bool(fields.get("stream"))
    path = f"/v2/models/{model}/generate" + ("_stream" if stream else "")
    conn.request("POST", path, json.dumps(fields), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out: dict = {"text": "", "responses": 0}
    try:
        if not stream:
            body = json.loads(resp.read() or b"{}")
            if resp.status != 200 or "error" in body:
                raise ServerError(body.get("error", f"HTTP {resp.status}"))
            events = [body]
        else:
            events = _sse(resp)  # an error is an event too (status 400 when it comes first)
        for ev in events:
            if "error" in ev:
                raise ServerError(ev["error"])
            out["responses"] += 1
            text = ev.get("text_output")
            if text:
                out["text"] += text
                if on_text:
                    on_text(text)
            for k in OUTPUTS:
                if k in ev:
                    _merge(out, k, ev[k])
        return out
    finally:
        conn.close()


def _sse(resp):
    for raw in resp:
        line = raw.decode("utf-8").strip()
        if line.startswith("data:"):
            yield json.loads(line[5:])
        elif line.startswith("{"):  # a plain JSON error (e.g. an unknown model)
            yield json.loads(line)
    if resp.status != 200:
        yield {"error": f"HTTP {resp.status}"}


# The model sends an optional output only when its return_* input is true (vllm_backend's rule),
# then on every response; num_output_tokens then counts the tokens new on each response.
USAGE_FLAGS = {"return_finish_reason": True, "return_num_input_tokens": True,
               "return_num_output_tokens": True}


def _merge(out: dict, name: str, v) -> None:
    """One response's optional output into `out`: num_output_tokens summed, others the latest."""
    if name == "num_output_tokens":
        out[name] = out.get(name, 0) + v
    else:
        out[name] = v


def generate(fields: dict, protocol: str = "grpc", url: str | None = None, model: str = "llm",
             on_text=None) -> dict:
    """One request; `fields` asks for finish_reason and usage unless it sets their flags."""
    fields = {**USAGE_FLAGS, **fields}
    url = url or DEFAULT_URL[protocol]
    fn = generate_grpc if protocol == "grpc" else generate_http
    return fn(fields, url, model, on_text)


def request_fields(args, text: str) -> dict:
    fields = {"text_input": text, "max_tokens": args.max_tokens, "stream": bool(args.stream),
              "temperature": args.temperature, "exclude_input_in_output": True}
    if args.seed is not None:
        fields["seed"] = args.seed
    if args.stop:
        fields["stop_words"] = list(args.stop)
    return fields


def print_usage(out: dict, seconds: float) -> None:
    sys.stdout.write("\n")
    sys.stdout.flush()
    n_in, n_out = out.get("num_input_tokens"), out.get("num_output_tokens")
    rate = f", {n_out / seconds:.1f} tok/s" if n_out else ""
    print(f"[finish_reason={out.get('finish_reason')} prompt_tokens={n_in} "
          f"completion_tokens={n_out} time={seconds:.2f}s{rate}]", file=sys.stderr)


def main(args) -> int:
    t0 = time.perf_counter()

    def show(text):
        sys.stdout.write(text)
        sys.stdout.flush()
    try:
        out = generate(request_fields(args, args.prompt), args.protocol, args.url, args.model,
                       on_text=show)
    except (ServerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_usage(out, time.perf_counter() - t0)
    return 0


def add_arguments(p) -> None:
    """Shared by generate and chat."""
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--url", default=None, help="host:port (default localhost:8001 grpc, :8000 http)")
    p.add_argument("--model", default="llm", help="model name in the repository (default llm)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
