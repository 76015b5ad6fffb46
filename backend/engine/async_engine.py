"""The engine on its own thread: other threads add requests, read their deltas, abort them.

Validation and tokenization run in the caller's thread (so a bad request fails at once, in the
caller); the engine thread only admits, steps and routes outputs.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Protocol

from backend.engine.errors import EngineUnavailable
from backend.engine.llm_engine import LLMEngine
from backend.engine.lost_rank import find_lost, rebuild_notice, step_error
from backend.engine.outputs import RequestOutput
from backend.engine.sampling.sampling_params import SamplingParams

log = logging.getLogger("backend.engine")


class OutputSink(Protocol):
    def put(self, item: RequestOutput) -> None: ...


class RequestStream:
    """Iterates one request's RequestOutputs until the finished one."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._q: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.finished = False

    def put(self, item: RequestOutput) -> None:
        self._q.put(item)

    def get(self, timeout: float | None = None) -> RequestOutput:
        item = self._q.get(timeout=timeout)
        self.finished = item.finished
        return item

    def __iter__(self):
        while not self.finished:
            yield self.get()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, warm_up: bool = False):
        """Starts the engine thread. With `warm_up` (an engine made with defer_warmup=True) the
        thread first warms the engine up, so the thread that serves is the thread that was
        warmed; wait_ready() returns when it is done."""
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, OutputSink] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._ready = threading.Event()
        self._warmup_error: BaseException | None = None
        self._refusal: str | None = None  # set while a multi-host TP group is being rebuilt
        self._thread = threading.Thread(target=self._run, args=(warm_up,), name="engine",
                                        daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the engine thread has warmed up; re-raises a warmup failure."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the engine did not warm up in {timeout}s")
        if self._warmup_error is not None:
            raise RuntimeError(f"warmup failed: {self._warmup_error}") from self._warmup_error

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None,
                    sink: OutputSink | None = None) -> OutputSink:
        self._check_open()
        return self._submit(self.engine.prepare_request(request_id, prompt, params), sink)

    def add_embedding(self, request_id: str, prompt: str | list[int],
                      dimensions: int | None = None,
                      sink: OutputSink | None = None) -> OutputSink:
        """An embedding request: one final output carrying `embedding`."""
        self._check_open()
        return self._submit(self.engine.prepare_embedding(request_id, prompt, dimensions), sink)

    def _check_open(self) -> None:
        if self._stopping:
            raise EngineUnavailable("the engine is shutting down")
        if self._refusal is not None:
            raise EngineUnavailable(self._refusal)

    def _submit(self, prepared, sink: OutputSink | None) -> OutputSink:
        """Hand a prepared request to the engine thread; its outputs go to `sink`."""
        sink = sink if sink is not None else RequestStream(prepared.request_id)
        self._commands.put(("add", prepared, sink))
        self._wake.set()
        return sink

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still in flight get a final 'abort' output."""
        self._stopping = True
        self._commands.put(("stop", None, None))
        self._wake.set()
        self._thread.join(timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    def _run(self, warm_up: bool) -> None:
        try:
            if warm_up:
                self.engine.warm_up()
        except BaseException as e:  # reported by wait_ready(); the thread has nothing to serve
            self._warmup_error = e
            return
        finally:
            self._ready.set()
        self._loop()

    def _loop(self) -> None:
        while True:
            if not self._drain_commands():
                break
            if not self.engine.has_unfinished():
                if self.engine.needs_recovery:
                    if self._refusal is None:  # a rank died between steps
                        self._refusal = rebuild_notice(find_lost(self.engine.group, wait_s=0))
                    self._recover()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step fails its requests, never the thread
                log.exception("engine step failed")  # the details stay in the log
                error, lost = step_error(self.engine.group, e)
                self._refusal = rebuild_notice(lost)  # before the failures reach the clients
                outputs = self.engine.abort_all("error", error)
                self._route(outputs)
                if self.engine.needs_recovery:
                    self._recover()
                continue
            self._route(outputs)
        self._route(self.engine.abort_all("abort", "the engine shut down"))

    def _recover(self) -> None:
        """A TP worker died: rebuild the group; requests arriving meanwhile wait in the queue
        (one host) or are refused (a group across hosts: lost_rank.rebuild_notice)."""
        if self._refusal:
            log.warning("%s", self._refusal)
        try:
            self.engine.recover()
            self._refusal = None
        except Exception:
            log.exception("rebuilding the tensor-parallel group failed; retrying in 5s")
            time.sleep(5.0)

    def _drain_commands(self) -> bool:
        while True:
            try:
                kind, arg, sink = self._commands.get_nowait()
            except queue.Empty:
                return True
            if kind == "stop":
                return False
            if kind == "add":
                try:
                    self.engine.add_request(arg.request_id, arg)
                    self._sinks[arg.request_id] = sink
                except ValueError as e:
                    sink.put(RequestOutput(arg.request_id, "", [], True, "error",
                                           len(arg.prompt_token_ids), 0, error=str(e)))
            elif kind == "abort":
                out = self.engine.abort_request(arg)
                if out is not None:
                    self._route([out])

    def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            try:
                sink.put(out)
            except Exception:  # a broken consumer must not stop the engine
                log.exception("output sink for %s failed", out.request_id)
