"""The response thread: engine deltas -> Triton responses; client cancellation -> engine abort.

The engine thread only put()s RequestOutputs here (a queue append), so sending (an IPC to the
server per response) never delays a step. Cancellation is polled per request every
`cancel_interval` seconds (`is_cancelled()` is an IPC too); gauges every `poll_interval`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

from backend.engine.outputs import RequestOutput
from backend.triton.response import StreamState, mean_itl, record_tokens, tensors_for

log = logging.getLogger("backend.triton")
_STOP = object()


class Responder:
    def __init__(self, pb, engine, metrics, snapshot=None, poll_interval: float = 0.1,
                 cancel_interval: float = 0.25):
        self.pb, self.engine, self.metrics = pb, engine, metrics  # engine: an AsyncEngine
        self.snapshot = snapshot or (lambda: {})
        self.poll_interval, self.cancel_interval = poll_interval, cancel_interval
        self.active: dict[str, StreamState] = {}
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        # delivery latency: engine output -> response handed to Triton (sum s, count, max s)
        self.delivery = [0.0, 0, 0.0]
        self._thread = threading.Thread(target=self._loop, name="responder", daemon=True)
        self._thread.start()

    # ---- called from other threads ----------------------------------------------------------
    def put(self, out: RequestOutput) -> None:
        """The engine's output sink (engine thread)."""
        self._q.put((time.perf_counter(), out))

    def register(self, state: StreamState) -> None:
        self.active[state.request_id] = state

    def unregister(self, request_id: str) -> None:
        self.active.pop(request_id, None)

    def send_error(self, sender, message: str, code=None) -> None:
        pb = self.pb
        err = pb.TritonError(message) if code is None else pb.TritonError(message, code)
        try:
            sender.send(pb.InferenceResponse(error=err),
                        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:  # the client may be gone already
            log.debug("could not send error %r: %s", message, e)

    def abort_all(self, message: str) -> int:
        """Ends every in-flight request with an error `message` (server shutdown)."""
        states = [s for s in list(self.active.values()) if not s.cancelled and not s.abort_error]
        for state in states:
            state.abort_error = message
            self.engine.abort(state.request_id)
        return len(states)

    def stop(self, timeout: float = 10.0) -> None:
        """After the engine has shut down (its final outputs are queued): send them, then fail
        whatever is still open."""
        self._q.put(_STOP)
        self._thread.join(timeout)
        for state in list(self.active.values()):
            self.send_error(state.sender, "request aborted: the model is being unloaded",
                            getattr(self.pb.TritonError, "UNAVAILABLE", None))
        self.active.clear()

    # ---- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        next_poll, next_log, logged = 0.0, time.perf_counter() + 30, 0
        while True:
            try:
                item = self._q.get(timeout=self.poll_interval if self.active else 0.5)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            try:
                if item is not None:
                    t_put, out = item
                    if self._handle(out):
                        d = time.perf_counter() - t_put
                        self.delivery[0] += d
                        self.delivery[1] += 1
                        self.delivery[2] = max(self.delivery[2], d)
                now = time.perf_counter()
                if now >= next_poll:
                    next_poll = now + self.poll_interval
                    self._poll_cancelled(now)
                    self.metrics.refresh(self.snapshot())
                    if now >= next_log and self.delivery[1] != logged:
                        next_log, logged = now + 30, self.delivery[1]
                        log.info("responses so far: %s", self.delivery_summary())
            except Exception:  # never let one bad response stop all streaming
                log.exception("response thread error")
        try:
            self.metrics.refresh(self.snapshot(), force=True)
        except Exception:
            pass

    def _poll_cancelled(self, now: float) -> None:
        for state in list(self.active.values()):
            if state.cancelled or now - state.last_cancel_check < self.cancel_interval:
                continue
            state.last_cancel_check = now
            try:
                cancelled = state.sender.is_cancelled()
            except Exception:
                cancelled = False
            if cancelled:
                self._cancel(state)

    def _cancel(self, state: StreamState) -> None:
        state.cancelled = True
        log.info("request %s cancelled by the client: aborting", state.request_id)
        self.engine.abort(state.request_id)  # frees its KV blocks; a final 'abort' output follows

    def delivery_summary(self) -> str:
        total, n, worst = self.delivery
        return (f"{n} responses, engine output -> sent: mean {1e3 * total / n:.3f} ms, "
                f"max {1e3 * worst:.1f} ms") if n else "no responses"

    def _handle(self, out: RequestOutput) -> bool:
        """Sends what `out` calls for; True when a data response went out."""
        state = self.active.get(out.request_id)
        if state is None:
            return False
        pb, final_flag = self.pb, self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if out.finished:
            self.active.pop(out.request_id, None)
        now = time.perf_counter()
        if state.cancelled:
            if out.finished:
                self._finished(state, out, now)
                try:  # close the response stream; the client has stopped listening
                    state.sender.send(flags=final_flag)
                except Exception:
                    pass
            return False
        if state.abort_error and out.finished:
            self._finished(state, out, now)
            self.send_error(state.sender, state.abort_error,
                            getattr(pb.TritonError, "UNAVAILABLE", None))
            return False
        if out.error is not None or out.finish_reason == "error":
            self._finished(state, out, now)
            msg = out.error or "request failed"
            if out.finish_reason == "abort":
                msg = f"request aborted: {msg}"
            code = getattr(pb.TritonError, "INVALID_ARG", None) if out.invalid else None
            self.send_error(state.sender, msg, code)
            return False
        n_before, t_before = state.num_output_tokens, state.last_token_time
        ttft = record_tokens(state, out, now)
        if ttft is not None:
            self.metrics.observe_ttft(ttft, out.num_input_tokens)
        if state.num_output_tokens > n_before:
            self.metrics.observe_tokens(state.num_output_tokens - n_before,
                                        None if t_before is None else now - t_before)
        tensors = tensors_for(state, out)
        if out.finished:
            self._finished(state, out, now)
        if tensors is None:
            return False
        resp = pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in tensors.items()])
        try:
            state.sender.send(resp, flags=final_flag if out.finished else 0)
        except Exception as e:
            log.info("request %s: send failed (%s): aborting", state.request_id, e)
            if not out.finished:
                self._cancel(state)
            return False
        return True

    def _finished(self, state: StreamState, out: RequestOutput, now: float) -> None:
        reason = "abort" if state.cancelled else (out.finish_reason or "error")
        itl = mean_itl(state)
        if itl is not None:
            self.metrics.observe_itl(itl)
        self.metrics.request_finished(reason, now - state.arrival, out.num_input_tokens,
                                      out.num_output_tokens)
