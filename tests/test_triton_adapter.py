"""TritonLLMModel.execute() without a server: no request can make it raise, every bad request gets
its own answer (INVALID_ARG naming the field, or an INTERNAL error that shows nothing of Python),
and the other requests of the same call are still submitted. Triton's pb_utils and the engine are
small fakes; the Responder is the real one."""
from __future__ import annotations

import itertools
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from backend.engine.errors import EngineUnavailable

from backend.triton import adapter as adapter_mod
from backend.triton.adapter import TritonLLMModel
from backend.triton.metrics import NullMetrics
from backend.triton.responder import Responder


class FakeError:
    INVALID_ARG, INTERNAL, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "UNAVAILABLE"

    def __init__(self, message: str, code: str | None = None):
        self.msg, self.code = message, code

    def message(self) -> str:
        return self.msg


class FakeResponse:
    def __init__(self, output_tensors=None, error=None):
        self.output_tensors, self.error = output_tensors, error


pb = SimpleNamespace(TritonError=FakeError, InferenceResponse=FakeResponse,
                     TRITONSERVER_RESPONSE_COMPLETE_FINAL=1, Tensor=lambda k, v: (k, v))


class FakeSender:
    def __init__(self):
        self.sent: list[tuple[FakeResponse | None, int]] = []

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        return False


class FakeTensor:
    def __init__(self, name: str, value: np.ndarray):
        self._name, self._value = name, value

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._value


class FakeRequest:
    def __init__(self, text: str, sampling: dict | str | None = None, parameters: str = "{}",
                 **tensors):
        self.sender = FakeSender()
        inputs = {"text_input": text, **tensors}
        if sampling is not None:
            inputs["sampling_parameters"] = sampling if isinstance(sampling, str) \
                else json.dumps(sampling)
        self._inputs = [FakeTensor(k, np.array([v.encode() if isinstance(v, str) else v],
                                               dtype=object if isinstance(v, str) else None))
                        for k, v in inputs.items()]
        self._parameters = parameters

    def get_response_sender(self) -> FakeSender:
        return self.sender

    def inputs(self):
        return self._inputs

    def parameters(self) -> str:
        return self._parameters

    def requested_output_names(self):
        return ["text_output"]

    def error(self) -> FakeError | None:
        """The error this request was answered with (its only, final response), or None."""
        if not self.sender.sent:
            return None
        assert len(self.sender.sent) == 1, self.sender.sent
        response, flags = self.sender.sent[0]
        assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        return response.error


class FakeEngine:
    def __init__(self, fail: dict[str, BaseException] | None = None):
        self.added: list[tuple[str, str]] = []
        self.fail = fail or {}

    def add_request(self, rid, prompt, params, sink=None):
        if prompt in self.fail:
            raise self.fail[prompt]
        self.added.append((rid, prompt))
        return sink

    def abort(self, rid):
        pass


@pytest.fixture
def model():
    m = TritonLLMModel.__new__(TritonLLMModel)  # what initialize() sets, minus the engine
    m.pb, m._stopping, m._prefix, m._ids = pb, False, "llm_0-test", itertools.count()
    m.tokenizer, m.llm = None, SimpleNamespace(max_model_len=2048, config=SimpleNamespace(max_num_seqs=64))
    m.engine, m.metrics = FakeEngine(), NullMetrics()
    m.responder = Responder(pb, m.engine, m.metrics)
    yield m
    m.responder.active.clear()
    m.responder.stop(timeout=5)


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def prompts_submitted(m) -> list[str]:
    return [p for _, p in m.engine.added]


def test_an_arbitrary_parser_exception_is_a_per_request_internal_error(model, monkeypatch, caplog):
    real = adapter_mod.parse_request

    def parse(inputs, parameters, *limits):
        if inputs["text_input"][0] == b"boom":
            raise KeyError("secret internals")
        return real(inputs, parameters, *limits)
    monkeypatch.setattr(adapter_mod, "parse_request", parse)
    batch = [FakeRequest("first"), FakeRequest("boom"), FakeRequest("last")]
    with caplog.at_level(logging.ERROR, logger="backend.triton"):
        assert model.execute(batch) is None
    assert prompts_submitted(model) == ["first", "last"]
    assert batch[0].error() is None and batch[2].error() is None
    err = batch[1].error()
    assert err.code == FakeError.INTERNAL
    assert err.msg.startswith("internal error: the request could not be processed")
    for leak in ("KeyError", "secret", "Traceback", "File "):
        assert leak not in err.msg
    rid = "llm_0-test-1"
    assert rid in err.msg and rid not in model.responder.active
    logged = [r for r in caplog.records if rid in r.getMessage()]
    assert logged and logged[0].exc_info and logged[0].exc_info[0] is KeyError  # traceback logged


def test_an_engine_exception_is_internal_and_unregisters(model):
    model.engine.fail = {"bad": IndexError("x"), "also bad": RuntimeError("not a shutdown")}
    batch = [FakeRequest("bad"), FakeRequest("good"), FakeRequest("also bad")]
    model.execute(batch)
    assert prompts_submitted(model) == ["good"]
    for r in (batch[0], batch[2]):
        assert r.error().code == FakeError.INTERNAL and "Error" not in r.error().msg
    assert list(model.responder.active) == ["llm_0-test-1"]  # only the submitted one


def test_the_engine_shutting_down_is_unavailable(model):
    req = FakeRequest("late")

    def add(rid, prompt, params, sink=None):
        model._stopping = True  # _teardown sets it, then shuts the engine down, meanwhile
        raise EngineUnavailable("the engine is shutting down")
    model.engine.add_request = add
    model.execute([req])
    assert req.error().code == FakeError.UNAVAILABLE
    assert req.error().msg == "the engine is shutting down"


def test_a_missing_response_sender_does_not_stop_the_batch(model):
    broken = FakeRequest("no sender")
    broken.get_response_sender = lambda: (_ for _ in ()).throw(OSError("gone"))
    batch = [broken, FakeRequest("served")]
    model.execute(batch)
    assert prompts_submitted(model) == ["served"]


BAD = [  # (request, the error's start): each is INVALID_ARG, the good ones around it are served
    (lambda: FakeRequest("x", '{"stop": ' + deep(10_000) + "}"),
     "sampling_parameters: nested deeper than 64"),
    (lambda: FakeRequest(deep(10_000), chat=np.bool_(True)),
     "text_input: chat messages: nested deeper than 64"),
    (lambda: FakeRequest("x", parameters='{"a": ' + deep(10_000) + "}"),
     "parameters: nested deeper than 64"),
    (lambda: FakeRequest("x", {"guided_json": '{"a": ' + deep(5_000) + "}"}),
     "sampling_parameters.guided_json: nested deeper than 64"),
    (lambda: FakeRequest("x", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": json.loads("{" + '"a": {' * 70 + "}" * 70 + "}")}}}),
     "sampling_parameters: nested deeper than 64"),
    (lambda: FakeRequest("x", '{"stop": ["' + "a" * (5 << 20) + '"]}'),
     "sampling_parameters: at most 4194304 characters of JSON"),
    (lambda: FakeRequest("x", {"logprobs": 1_000_000}),
     "sampling_parameters.logprobs: must be in [0, 20], got 1000000"),
    (lambda: FakeRequest("x", {"top_logprobs": -1}),
     "sampling_parameters.top_logprobs: must be in [0, 20], got -1"),
    (lambda: FakeRequest("x", '{"max_tokens": ' + "9" * 5000 + "}"),
     "sampling_parameters: not valid JSON (a number with too many digits)"),
]


@pytest.mark.parametrize("make, message", BAD, ids=[m.split(":")[0] + str(i)
                                                    for i, (_, m) in enumerate(BAD)])
def test_bad_json_is_invalid_arg_between_good_requests(model, make, message):
    batch = [FakeRequest("before"), make(), FakeRequest("after")]
    model.execute(batch)
    assert prompts_submitted(model) == ["before", "after"]
    err = batch[1].error()
    assert err.code == FakeError.INVALID_ARG and err.msg.startswith(message), err.msg
    assert len(err.msg) <= adapter_mod.MAX_ERROR_CHARS + 4


def test_logprobs_in_range_is_accepted_without_return_logprobs(model):
    req = FakeRequest("x", {"logprobs": 20})
    model.execute([req])
    assert req.error() is None and prompts_submitted(model) == ["x"]


def test_a_group_being_rebuilt_is_unavailable_not_internal(model):
    """A TP group across hosts refuses requests while it is rebuilt: the client gets the
    engine's notice (which rank, retry) as UNAVAILABLE, the model is not stopping."""
    req = FakeRequest("meanwhile")
    notice = ("unavailable: tensor-parallel rank 1 (the worker on host h) was lost; the "
              "tensor-parallel group is being rebuilt; retry later")

    def add(rid, prompt, params, sink=None):
        raise EngineUnavailable(notice)
    model.engine.add_request = add
    model.execute([req])
    assert not model._stopping
    assert req.error().code == FakeError.UNAVAILABLE and req.error().msg == notice
    assert list(model.responder.active) == []
