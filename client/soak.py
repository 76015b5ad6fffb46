"""`python -m client soak`: a long mixed load against the server, checking that it stays sound.

N requests at concurrency C, each drawn from a seeded generator: gRPC streaming or not, HTTP
generate or generate_stream; random prompt lengths, max_tokens and sampling; a fraction cancelled
by the client at a random point (gRPC stream cancel, HTTP disconnect) and a small fraction
deliberately invalid (out-of-range values, bad JSON, JSON 10,000 levels deep, logprobs past the
maximum). Every outcome is classified: `ok`, expected (`cancelled`, `invalid` with an error naming
the field) or unexplained (anything else: an error on a valid request, a missing final response,
a timeout, an invalid request accepted). At the end: the KV blocks in use (they
must be back to 0 of the total), the engine gauges, and the resident memory of the server's
process tree while the 2nd hundred and the last hundred requests completed (growth %).

Starts its own server (python -m backend.serve via client/server.py) unless --grpc-url/--http-url
point at one (then --server-pid enables the memory figures). Not part of the test suite.
"""
from __future__ import annotations

import collections
import http.client
import json
import queue
import random
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from client.bench.benchutil import default_out, write_json
from client.generate import grpc_inputs

WORDS = ("river mountain city light story number garden window music ocean forest winter "
         "history science market letter friend morning journey question answer engine "
         "language picture bridge summer castle dragon planet rocket coffee library").split()
PROTOCOLS = ("grpc_stream", "grpc", "http_stream", "http")
# deliberately invalid requests: (extra fields, the field the error must start with)
DEEP = "[" * 10_000 + "]" * 10_000  # json.loads alone would raise RecursionError on it
INVALID = [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
           ({"top_p": 1.5}, "top_p"), ({"text_input": ""}, "text_input"),
           ({"sampling_parameters": "{oops"}, "sampling_parameters"),
           ({"sampling_parameters": '{"stop": ' + DEEP + "}"}, "sampling_parameters"),
           ({"text_input": DEEP, "chat": True}, "text_input"),
           ({"sampling_parameters": '{"logprobs": 1000000}'}, "sampling_parameters.logprobs")]


@dataclass
class Spec:
    index: int
    protocol: str
    fields: dict
    cancel_after: int | None = None  # cancel after this many responses (0 = before the first)
    cancel_delay: float = 0.0
    invalid_field: str | None = None


@dataclass
class Outcome:
    index: int
    protocol: str
    kind: str  # ok | cancelled | invalid | unexplained
    detail: str = ""
    responses: int = 0
    seconds: float = 0.0
    num_output_tokens: int | None = None


def make_specs(n: int, seed: int, cancel_fraction: float, invalid_fraction: float,
               prompt_words: tuple[int, int], max_tokens: tuple[int, int]) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        words = rng.randint(*prompt_words)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        fields = {"text_input": f"Request {i}. {prompt}", "max_tokens": rng.randint(*max_tokens),
                  "temperature": rng.choice([0.0, 0.0, 0.8]), "ignore_eos": rng.random() < 0.5,
                  "exclude_input_in_output": True, "return_num_output_tokens": True}
        if fields["temperature"]:
            fields.update(seed=rng.randrange(2**32), top_p=0.95)
        protocol = rng.choice(PROTOCOLS)
        spec = Spec(i, protocol, fields)
        r = rng.random()
        if r < cancel_fraction:
            spec.protocol = rng.choice(("grpc_stream", "grpc", "http_stream"))  # cancellable
            spec.cancel_after = rng.choice((0, 0, 1, 2, 4))
            spec.cancel_delay = rng.uniform(0.0, 0.5)
            fields["max_tokens"] = max(fields["max_tokens"], 32)
            fields["ignore_eos"] = True
        elif r < cancel_fraction + invalid_fraction:
            extra, spec.invalid_field = rng.choice(INVALID)
            fields.update(extra)
        fields["stream"] = spec.protocol in ("grpc_stream", "http_stream")
        specs.append(spec)
    return specs


# ---- one request ------------------------------------------------------------------------------
def _run_grpc(spec: Spec, url: str, timeout: float) -> Outcome:
    import tritonclient.grpc as grpcclient
    out = Outcome(spec.index, spec.protocol, "unexplained")
    client = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    cancel = False
    try:
        client.async_stream_infer("llm", grpc_inputs(spec.fields),
                                  enable_empty_final_response=True)
        if spec.cancel_after == 0:
            time.sleep(spec.cancel_delay)
            cancel = True
            out.kind = "cancelled"
            return out
        while True:
            result, error = q.get(timeout=timeout)
            if error is not None:
                return _error(out, spec, error.message())
            resp = result.get_response()
            if resp.outputs:
                out.responses += 1
                n = _np_scalar(result, "num_output_tokens")
                if n is not None:  # the tokens new on this response
                    out.num_output_tokens = (out.num_output_tokens or 0) + n
            if resp.parameters["triton_final_response"].bool_param:
                return _final(out, spec)
            if spec.cancel_after is not None and out.responses >= spec.cancel_after:
                cancel = True
                out.kind = "cancelled"
                return out
    except queue.Empty:
        out.detail = f"no response for {timeout:.0f}s"
        return out
    finally:
        client.stop_stream(cancel_requests=cancel)
        client.close()


def _np_scalar(result, name):
    try:
        arr = result.as_numpy(name)
    except Exception:
        return None
    return None if arr is None or arr.size == 0 else int(arr.reshape(-1)[0])


def _run_http(spec: Spec, url: str, timeout: float) -> Outcome:
    out = Outcome(spec.index, spec.protocol, "unexplained")
    host, _, port = url.partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    stream = spec.protocol == "http_stream"
    try:
        conn.request("POST", "/v2/models/llm/generate" + ("_stream" if stream else ""),
                     json.dumps(spec.fields))
        if spec.cancel_after == 0:
            time.sleep(spec.cancel_delay)
            out.kind = "cancelled"
            return out
        resp = conn.getresponse()
        if not stream:
            body = json.loads(resp.read() or b"{}")
            if "error" in body:
                return _error(out, spec, body["error"])
            out.responses, out.num_output_tokens = 1, body.get("num_output_tokens")
            return _final(out, spec)
        for raw in resp:  # an error is an event too (with status 400 when it comes first)
            if not raw.startswith((b"data:", b"{")):
                continue
            ev = json.loads(raw[5:] if raw.startswith(b"data:") else raw)
            if "error" in ev:
                return _error(out, spec, ev["error"])
            out.responses += 1
            if ev.get("num_output_tokens") is not None:  # the tokens new on this event
                out.num_output_tokens = (out.num_output_tokens or 0) + ev["num_output_tokens"]
            if spec.cancel_after is not None and out.responses >= spec.cancel_after:
                out.kind = "cancelled"
                return out
        if resp.status != 200:
            return _error(out, spec, f"HTTP {resp.status} without an error event")
        return _final(out, spec)  # the server ends the event stream after the final response
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        out.detail = f"{type(e).__name__}: {e}"
        return out
    finally:
        if out.kind == "cancelled" and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # the client vanishes
            except OSError:
                pass
        conn.close()


def _error(out: Outcome, spec: Spec, message: str) -> Outcome:
    if spec.invalid_field and message.startswith(spec.invalid_field):
        out.kind = "invalid"
    out.detail = message[:300]
    return out


def _final(out: Outcome, spec: Spec) -> Outcome:
    if spec.invalid_field:
        out.detail = f"invalid request ({spec.invalid_field}) was accepted"
    elif spec.cancel_after is not None:
        out.kind, out.detail = "ok", "finished before the cancel"
    elif out.num_output_tokens is None or not 1 <= out.num_output_tokens <= spec.fields["max_tokens"]:
        out.detail = f"num_output_tokens {out.num_output_tokens} (max_tokens " \
                     f"{spec.fields['max_tokens']})"
    else:
        out.kind = "ok"
    return out


# ---- server side ------------------------------------------------------------------------------
def tree_rss_bytes(root: int) -> int | None:
    """Resident memory of `root` and its descendants (sum of VmRSS)."""
    seen, todo, total = set(), [root], 0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                todo += [int(x) for x in task.read_text().split()]
        except (OSError, ValueError):
            continue
    return total if seen else None


def read_metrics(url: str) -> dict[str, float]:
    """The llm_* metrics summed over instances: {'name' or 'name{finish_reason=...}': value}."""
    import urllib.request
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if not line.startswith("llm_"):
            continue
        key, _, value = line.rpartition(" ")
        name, _, labels = key.partition("{")
        reason = [p for p in labels.rstrip("}").split(",") if p.startswith("finish_reason=")]
        out[name + (f"{{{reason[0]}}}" if reason else "")] += float(value)
    return dict(out)


# ---- the run ----------------------------------------------------------------------------------
def run(args, grpc_url: str, http_url: str, metrics_url: str, server_pid: int | None) -> dict:
    specs = make_specs(args.requests, args.seed, args.cancel_fraction, args.invalid_fraction,
                       tuple(args.prompt_words), tuple(args.max_tokens))
    before = read_metrics(metrics_url)
    outcomes: list[Outcome] = []
    rss: list[tuple[int, int]] = []  # (requests completed, bytes)
    lock = threading.Lock()
    t_start = time.perf_counter()

    def one(spec: Spec) -> Outcome:
        t0 = time.perf_counter()
        try:
            if spec.protocol.startswith("grpc"):
                out = _run_grpc(spec, grpc_url, args.timeout)
            else:
                out = _run_http(spec, http_url, args.timeout)
        except Exception as e:  # a client-side failure is unexplained too
            out = Outcome(spec.index, spec.protocol, "unexplained", f"{type(e).__name__}: {e}")
        out.seconds = time.perf_counter() - t0
        with lock:
            outcomes.append(out)
            done = len(outcomes)
            if server_pid is not None and (done % 10 == 0 or done == 1):
                rss.append((done, tree_rss_bytes(server_pid) or 0))
            if done % 100 == 0:
                kinds = collections.Counter(o.kind for o in outcomes)
                print(f"  {done}/{len(specs)} in {time.perf_counter() - t_start:.0f}s: "
                      f"{dict(kinds)}", file=sys.stderr, flush=True)
        return out

    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(one, specs))
    wall = time.perf_counter() - t_start
    # the server settles: every block back, nothing running
    deadline = time.monotonic() + 60
    while True:
        after = read_metrics(metrics_url)
        if (after.get("llm_kv_cache_blocks_used", 0) == 0
                and after.get("llm_num_requests_running", 0) == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    kinds = collections.Counter(o.kind for o in outcomes)
    unexplained = [asdict(o) for o in outcomes if o.kind == "unexplained"]
    by_detail = collections.Counter(o["detail"][:80] for o in unexplained)
    rss_report = None
    if rss:
        second = [b for n, b in rss if 100 < n <= 200] or [rss[0][1]]
        last = [b for n, b in rss if n > len(specs) - 100] or [rss[-1][1]]
        a, b = statistics.fmean(second), statistics.fmean(last)
        rss_report = {"second_hundred_mib": a / 2**20, "last_hundred_mib": b / 2**20,
                      "growth_pct": 100 * (b - a) / a, "samples": rss}
    reasons = {k.split("=", 1)[1].strip('}"'): after[k] - before.get(k, 0)
               for k in after if k.startswith("llm_requests_total{")}
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("runner",)},
        "wall_seconds": wall,
        "requests": len(outcomes),
        "outcomes": dict(kinds),
        "expected_errors": {"cancelled": kinds.get("cancelled", 0),
                            "invalid": kinds.get("invalid", 0)},
        "unexplained": len(unexplained),
        "unexplained_by_detail": dict(by_detail),
        "unexplained_examples": unexplained[:20],
        "by_protocol": {p: dict(collections.Counter(o.kind for o in outcomes if o.protocol == p))
                        for p in PROTOCOLS},
        "latency_s": {"median": statistics.median(o.seconds for o in outcomes),
                      "max": max(o.seconds for o in outcomes)},
        "kv_blocks_used_end": after.get("llm_kv_cache_blocks_used"),
        "kv_blocks_total": after.get("llm_kv_cache_blocks_total"),
        "running_end": after.get("llm_num_requests_running"),
        "waiting_end": after.get("llm_num_requests_waiting"),
        "server_finish_reasons": reasons,
        "preemptions": after.get("llm_preemptions_total", 0) - before.get("llm_preemptions_total", 0),
        "cold_path_events": after.get("llm_cold_path_events_total"),
        "rss": rss_report,
    }


def print_report(r: dict) -> None:
    print(f"soak: {r['requests']} requests in {r['wall_seconds']:.0f}s at concurrency "
          f"{r['config']['concurrency']}")
    print(f"  outcomes: {r['outcomes']}  (expected errors: {r['expected_errors']})")
    print(f"  unexplained: {r['unexplained']}  {r['unexplained_by_detail'] or ''}")
    print(f"  KV blocks in use at the end: {r['kv_blocks_used_end']:.0f} of "
          f"{r['kv_blocks_total']:.0f}; running {r['running_end']:.0f}, waiting "
          f"{r['waiting_end']:.0f}; preemptions {r['preemptions']:.0f}")
    print(f"  server finish reasons: {r['server_finish_reasons']}")
    if r["rss"]:
        print(f"  RSS of the server tree: {r['rss']['second_hundred_mib']:.0f} MiB (2nd hundred) -> "
              f"{r['rss']['last_hundred_mib']:.0f} MiB (last hundred): "
              f"{r['rss']['growth_pct']:+.1f}%")


def verdict(r: dict) -> list[str]:
    """The soak's pass criteria; empty when it passed."""
    bad = []
    if r["unexplained"]:
        bad.append(f"{r['unexplained']} unexplained errors")
    if r["kv_blocks_used_end"] != 0:
        bad.append(f"{r['kv_blocks_used_end']:.0f} KV blocks still used")
    if r["rss"] and r["rss"]["growth_pct"] > 10:  # the criterion: growth <= 10%
        bad.append(f"RSS grew {r['rss']['growth_pct']:.1f}%")
    return bad


def main(args) -> int:
    srv = None
    if args.grpc_url and args.http_url and args.metrics_url:
        urls = (args.grpc_url, args.http_url, args.metrics_url)
        pid = args.server_pid
    else:
        import tempfile
        from client.server import Server, make_repo
        params = dict(kv.split("=", 1) for kv in args.param)
        d = Path(tempfile.mkdtemp(prefix="soak-"))
        repo = make_repo(d / "repo", params)
        print(f"soak: starting a server ({params or 'default parameters'}; log {d}/server.log)",
              file=sys.stderr, flush=True)
        srv = Server(repo, d / "server.log")
        srv.wait_ready(timeout=900)
        urls = (srv.grpc_url, srv.http_url, f"localhost:{srv.metrics_port}")
        pid = srv.proc.pid
    try:
        report = run(args, *urls, server_pid=pid)
    finally:
        if srv is not None:
            srv.stop()
    bad = verdict(report)
    report["verdict"] = bad or "pass"
    print_report(report)
    out = write_json(args.out or default_out("soak"), report)
    print(f"  {'PASS' if not bad else 'FAIL: ' + '; '.join(bad)}; report: {out}")
    return 1 if bad else 0


def add_arguments(p) -> None:
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--cancel-fraction", type=float, default=0.1)
    p.add_argument("--invalid-fraction", type=float, default=0.02)
    p.add_argument("--prompt-words", type=int, nargs=2, default=[4, 200], metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"))
    p.add_argument("--timeout", type=float, default=600, help="seconds without a response")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grpc-url", default=None, help="host:port of a running server's gRPC")
    p.add_argument("--http-url", default=None, help="host:port of its HTTP endpoint")
    p.add_argument("--metrics-url", default=None, help="host:port of its metrics endpoint")
    p.add_argument("--server-pid", type=int, default=None,
                   help="the running server's launcher/tritonserver pid (for the RSS figures)")
    p.add_argument("--param", action="append", default=["num_threads=2"],
                   help="config.pbtxt parameter of the server started here, k=v (repeatable)")
    p.add_argument("--out", default=None, help="JSON path (default bench_results/soak-<ts>.json)")

