"""The response thread and the metrics wrapper against a fake triton_python_backend_utils."""
import threading
import time

import numpy as np

from backend.engine.outputs import RequestOutput
from backend.triton.metrics import Metrics
from backend.triton.request import parse_request
from backend.triton.responder import Responder
from backend.triton.response import StreamState

FINAL = 1


class FakePB:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL

    class TritonError:
        INVALID_ARG, UNAVAILABLE = "INVALID_ARG", "UNAVAILABLE"

        def __init__(self, message, code=None):
            self.message, self.code = message, code

    class Tensor:
        def __init__(self, name, value):
            self.name, self.value = name, value

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.tensors = {t.name: t.value for t in output_tensors}
            self.error = error

    class MetricFamily:
        HISTOGRAM, COUNTER, GAUGE = "h", "c", "g"
        created = []

        def __init__(self, name, description, kind):
            self.name, self.kind = name, kind

        def Metric(self, labels, buckets=None):
            m = FakeMetric(self.name, labels)
            FakePB.MetricFamily.created.append(m)
            return m


class FakeMetric:
    def __init__(self, name, labels):
        self.name, self.labels, self.value, self.observed = name, labels, 0, []

    def observe(self, v):
        self.observed.append(v)

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v


class FakeSender:
    def __init__(self):
        self.sent, self.cancelled = [], False
        self.done = threading.Event()

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))
        if flags & FINAL:
            self.done.set()

    def is_cancelled(self):
        return self.cancelled


class FakeEngine:
    def __init__(self):
        self.aborted = []

    def abort(self, rid):
        self.aborted.append(rid)


def out(text, n, finished=False, reason=None, error=None):
    return RequestOutput("r1", text, [7] if text else [], finished, reason, 3, n, error=error)


def make(stream=True, **params):
    pb, engine = FakePB, FakeEngine()
    FakePB.MetricFamily.created = []
    metrics = Metrics(pb, {"model": "llm", "version": "1", "instance": "llm_0_0"})
    responder = Responder(pb, engine, metrics, poll_interval=0.02, cancel_interval=0.02)
    req = parse_request({"text_input": np.array([b"Hi"], dtype=object)},
                        {"stream": stream, **params})
    sender = FakeSender()
    responder.register(StreamState("r1", req, sender))
    return responder, engine, sender, metrics


def texts(sender):
    return [r.tensors["text_output"][0] for r, _ in sender.sent if r is not None and r.error is None]


def test_streams_deltas_and_records_metrics():
    responder, _, sender, metrics = make()
    for o in (out(" a", 1), out("", 1), out(" b", 2), out(" c", 3, True, "length")):
        responder.put(o)
    assert sender.done.wait(5)
    assert texts(sender) == [b" a", b" b", b" c"] and sender.sent[-1][1] == FINAL
    assert "num_output_tokens" not in sender.sent[-1][0].tensors  # not asked for
    responder.stop()
    assert metrics.counter["llm_generation_tokens_total"].value == 3
    assert len(metrics.hist["llm_time_to_first_token_seconds"].observed) == 1
    assert len(metrics.hist["llm_inter_token_latency_seconds"].observed) == 1
    assert responder.active == {}


def test_non_streaming_sends_one_response_with_the_prompt():
    responder, _, sender, _ = make(stream=False)
    responder.put(out(" a", 1))
    responder.put(out(" b", 2, True, "stop"))
    assert sender.done.wait(5)
    responder.stop()
    assert texts(sender) == [b"Hi a b"] and len(sender.sent) == 1


def test_client_cancel_aborts_the_engine_request_and_closes_the_stream():
    responder, engine, sender, metrics = make()
    responder.put(out(" a", 1))
    sender.cancelled = True
    deadline = time.monotonic() + 5
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.aborted == ["r1"]
    responder.put(out("", 1, True, "abort"))  # what the engine answers an abort with
    assert sender.done.wait(5)
    assert sender.sent[-1] == (None, FINAL)
    responder.stop()
    reasons = {m.labels.get("finish_reason"): m.value for m in FakePB.MetricFamily.created
               if m.name == "llm_requests_total"}
    assert reasons.get("abort") == 1


def test_engine_error_and_shutdown_abort_become_errors():
    responder, engine, sender, _ = make()
    responder.put(out("", 0, True, "error", error="engine step failed: boom"))
    assert sender.done.wait(5)
    assert sender.sent[-1][0].error.message == "engine step failed: boom"
    responder.stop()

    responder, engine, sender, _ = make()
    assert responder.abort_all("request aborted: the server is shutting down") == 1
    assert engine.aborted == ["r1"]
    responder.put(out("", 0, True, "abort"))
    assert sender.done.wait(5)
    err = sender.sent[-1][0].error
    assert err.message.endswith("shutting down") and err.code == "UNAVAILABLE"
    responder.stop()


def test_stop_fails_what_is_still_open():
    responder, _, sender, _ = make()
    responder.stop()
    assert sender.sent[-1][0].error.message.startswith("request aborted")


def test_gauges_refresh_only_on_change():
    metrics = Metrics(FakePB, {"model": "llm"}, interval=0)
    snap = {"llm_kv_cache_blocks_used": 5, "steps": 10, "sampled_tokens": 40,
            "scheduled_tokens": 300}
    metrics.refresh(snap)
    metrics.refresh({**snap, "steps": 12, "sampled_tokens": 48, "scheduled_tokens": 302})
    assert metrics.gauge["llm_kv_cache_blocks_used"].value == 5
    assert metrics.counter["llm_engine_steps_total"].value == 12
    assert metrics.counter["llm_engine_sampled_tokens_total"].value == 48
    assert metrics.counter["llm_engine_scheduled_tokens_total"].value == 302


def test_collective_time_is_a_counter():
    """The tensor-parallel breakdown reaches Triton's metrics as two cumulative counters."""
    metrics = Metrics(FakePB, {"model": "llm"}, interval=0)
    metrics.refresh({"model_seconds": 2.0, "collective_seconds": 0.25})
    metrics.refresh({"model_seconds": 3.5, "collective_seconds": 0.5})
    assert metrics.counter["llm_model_seconds_total"].value == 3.5
    assert metrics.counter["llm_collective_seconds_total"].value == 0.5


def test_vllm_metric_families_observe_per_token():
    """vllm:* families (labels model, version): TTFT once, time_per_output_token once per token
    after the first, token counters per output, request histograms at the end, and gauges from
    the engine snapshot (running/waiting kept as sums over replicas, KV usage a fraction)."""
    from backend.triton.vllm_metrics import VllmMetrics
    FakePB.MetricFamily.created = []
    vllm = VllmMetrics(FakePB, {"model": "llm", "version": "1"}, max_model_len=2048)
    metrics = Metrics(FakePB, {"model": "llm", "version": "1", "instance": "llm_0_0"}, vllm=vllm)
    responder = Responder(FakePB, FakeEngine(), metrics, poll_interval=0.02, cancel_interval=0.02)
    req = parse_request({"text_input": np.array([b"Hi"], dtype=object)}, {"stream": True})
    sender = FakeSender()
    responder.register(StreamState("r1", req, sender))
    for o in (out(" a", 1), out(" b c", 3), out("", 3), out(" d", 4, True, "length")):
        responder.put(o)
    assert sender.done.wait(5)
    responder.stop()
    assert all(m.labels == {"model": "llm", "version": "1"} for m in FakePB.MetricFamily.created
               if m.name.startswith("vllm:"))
    assert len(vllm.hist["vllm:time_to_first_token_seconds"].observed) == 1
    tpot = vllm.hist["vllm:time_per_output_token_seconds"].observed
    assert len(tpot) == 3 and tpot[0] == tpot[1] and all(v >= 0 for v in tpot)
    assert vllm.counter["vllm:generation_tokens_total"].value == 4
    assert vllm.counter["vllm:prompt_tokens_total"].value == 3
    assert vllm.hist["vllm:request_generation_tokens"].observed == [4]
    assert vllm.hist["vllm:request_prompt_tokens"].observed == [3]
    assert vllm.hist["vllm:request_params_n"].observed == [1]
    assert len(vllm.hist["vllm:e2e_request_latency_seconds"].observed) == 1
    snap = {"llm_num_requests_running": 2, "llm_num_requests_waiting": 1,
            "llm_kv_cache_blocks_used": 16, "llm_kv_cache_blocks_total": 64, "preemptions": 3,
            "prefix_cache_queries": 100, "prefix_cache_hits": 40}
    metrics.refresh(snap, force=True)
    metrics.refresh({**snap, "llm_num_requests_running": 1, "preemptions": 4}, force=True)
    assert vllm.gauge["vllm:num_requests_running"].value == 1
    assert vllm.gauge["vllm:num_requests_waiting"].value == 1
    assert vllm.gauge["vllm:kv_cache_usage_perc"].value == 0.25
    assert vllm.gauge["vllm:gpu_cache_usage_perc"].value == 0.25
    assert vllm.counter["vllm:num_preemptions_total"].value == 4
    assert vllm.counter["vllm:prefix_cache_hits_total"].value == 40
    assert vllm.counter["vllm:prefix_cache_queries_total"].value == 100
