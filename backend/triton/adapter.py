"""The Triton Python-backend model: one engine replica per model instance.

initialize() places the replica, loads (and warms up) the engine and returns only when it is
ready, so Triton reports READY only then. execute() validates each request, hands it to the
engine thread and returns at once; the Responder thread streams the deltas back. finalize()
aborts what is in flight (each stream gets a final error), stops both threads and the
tensor-parallel workers.
"""
from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

from backend.engine.errors import EngineUnavailable
from backend.triton.model_config import check_transaction_policy, parse_parameters
from backend.triton.placement import (compute_placement, count_visible_gpus,
                                      cuda_visible_devices, engine_device)
from backend.triton.request import (ALL_INPUTS, check_prompt_size, embedding_text,
                                    parse_embedding, parse_request, render_chat)
from backend.triton.response import StreamState
from backend.process_exit import exit_now
from backend.triton.shutdown import grace_seconds, watch_signals

log = logging.getLogger("backend.triton")
MAX_ERROR_CHARS = 1000  # an error message quoting a huge client value is cut to this


def _setup_logging(level: str, instance: str) -> None:
    root = logging.getLogger()
    if not any(getattr(h, "_tpllm", False) for h in root.handlers):
        h = logging.StreamHandler(sys.stderr)
        h._tpllm = True
        h.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{instance}] %(name)s: "
                                         "%(message)s", "%H:%M:%S"))
        root.addHandler(h)
    root.setLevel(level.upper())


def _fix_executable() -> None:
    """The stub embeds Python: child processes (tensor-parallel workers) must start the venv's
    interpreter, not the stub. The launcher exports TPLLM_PYTHON; else derive it from sys.prefix."""
    exe = os.environ.get("TPLLM_PYTHON") or str(Path(sys.prefix) / "bin" / "python")
    if not sys.executable or not os.path.exists(sys.executable) or \
            "triton_python_backend_stub" in sys.executable:
        sys.executable = exe
    multiprocessing.set_executable(sys.executable)


class TritonLLMModel:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb
        self.pb = pb
        t0 = time.perf_counter()
        config = json.loads(args["model_config"])
        name, instance = args["model_name"], args["model_instance_name"]
        engine_kwargs, opts = parse_parameters(config)
        _setup_logging(opts.log_level, instance)
        check_transaction_policy(config)
        placement = compute_placement(
            args.get("model_instance_kind", "CPU"), int(args.get("model_instance_device_id") or 0),
            instance, config.get("instance_group") or [],
            engine_kwargs.get("tensor_parallel_size", 1), opts.gpu_device_ids, count_visible_gpus())
        engine_kwargs["device"] = engine_device(placement, engine_kwargs.get("device"))
        if placement.device == "cuda":  # before anything initializes CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(placement.gpu_ids)
        model = engine_kwargs.get("model")
        if model and not os.path.isabs(os.path.expanduser(model)):  # relative to the model dir
            engine_kwargs["model"] = str(Path(args["model_repository"]).resolve() / model)
        _fix_executable()
        # The engine thread runs Python between torch ops; with the default 5 ms switch interval
        # the response thread may wait that long for the GIL after each IPC (send, metrics).
        sys.setswitchinterval(float(os.environ.get("TPLLM_SWITCH_INTERVAL", "0.001")))
        log.info("loading %s (%s): %s", name, placement.describe(),
                 ", ".join(f"{k}={v}" for k, v in engine_kwargs.items()) or "defaults")

        from backend.engine.config import EngineConfig
        from backend.engine.llm_engine import LLMEngine
        from backend.triton.lora_config import lora_modules
        try:  # LoRA adapters: multi_lora.json in the version folder (errors name it)
            engine_kwargs.update(lora_modules(engine_kwargs, args["model_repository"],
                                              args.get("model_version", "")))
            cfg = EngineConfig(**engine_kwargs)
            self.llm = LLMEngine(cfg, defer_warmup=True)  # warmed on the engine thread
        except Exception as e:
            raise RuntimeError(f"{name}: cannot load the engine: {e}") from e
        try:
            self._start(pb, name, args, opts)
        except BaseException:
            self.llm.close()  # no orphaned tensor-parallel workers
            raise
        self._ids = itertools.count()
        self._prefix = f"{instance}-{os.getpid()}"
        self._stopping = False
        self._teardown_lock = threading.Lock()
        self._torn_down = False
        # Only the real stub embeds c_python_backend_utils; elsewhere (tests) finalize() returns.
        self._in_stub = "c_python_backend_utils" in sys.modules
        watch_signals(self._on_signal)
        log.info("%s ready in %.1fs (%s; pid %d, engine thread %s, response thread %s)", name,
                 time.perf_counter() - t0, placement.describe(), os.getpid(),
                 self.engine._thread.native_id, self.responder._thread.native_id)

    def _start(self, pb, name: str, args: dict, opts) -> None:
        from backend.engine.async_engine import AsyncEngine
        from backend.triton.metrics import Metrics, NullMetrics, engine_snapshot
        from backend.triton.responder import Responder
        self.tokenizer = self.llm.tokenizer
        self.engine = AsyncEngine(self.llm, warm_up=True)
        self.engine.wait_ready()  # READY only after every bucket ran
        labels = {"model": name, "version": str(args.get("model_version", "")),
                  "instance": args["model_instance_name"]}
        if opts.enable_metrics:
            from backend.triton.vllm_metrics import VllmMetrics
            vllm = VllmMetrics(pb, {"model": name, "version": labels["version"]},
                               self.llm.max_model_len) if opts.vllm_metrics else None
            self.metrics = Metrics(pb, labels, vllm=vllm)
        else:
            self.metrics = NullMetrics()
        from backend.triton.lora_metrics import LoraRequests
        self.lora_requests = LoraRequests(pb, labels) if (
            opts.enable_metrics and self.llm.loras.ids) else None
        self.responder = Responder(pb, self.engine, self.metrics,
                                   snapshot=lambda: engine_snapshot(self.llm))

    # ---- requests ---------------------------------------------------------------------------
    # No request can make execute() raise: an exception escaping it fails every request of the
    # call (those already submitted included) and shows the client Python's message. So each
    # request is read and submitted under its own guard (_submit), and the loop has one more.
    def execute(self, requests) -> None:
        for request in requests:
            try:
                self._submit(request)
            except Exception:  # _submit answers its own failures; this is the last resort
                log.exception("request not submitted")
        return None

    def _read_inputs(self, request) -> dict:
        return {t.name(): t.as_numpy() for t in request.inputs() if t.name() in ALL_INPUTS}

    def _submit(self, request) -> None:
        """Reads, validates and submits one request; answers every failure on its own stream:
        ValueError -> INVALID_ARG with its message, anything else -> INTERNAL with a message
        that shows nothing of Python (the traceback goes to the log, with the request id)."""
        pb = self.pb
        sender = request.get_response_sender()
        arrival = time.perf_counter()
        if self._stopping:
            self.responder.send_error(sender, "the model is being unloaded",
                                      getattr(pb.TritonError, "UNAVAILABLE", None))
            return
        rid = f"{self._prefix}-{next(self._ids)}"
        # add_request is the last call that can fail: once it returns, the engine's outputs
        # answer the request, so nothing below ever sends a second, conflicting answer.
        try:
            inputs = self._read_inputs(request)
            embedding = embedding_text(inputs)
            if embedding is not None:
                req = parse_embedding(inputs, embedding)
                prompt = req.embedding.input
            else:
                req = parse_request(inputs, request.parameters(),
                                    self.llm.config.max_num_seqs)
                prompt = render_chat(self.tokenizer, req.messages) if req.chat else req.prompt
            if isinstance(prompt, str):
                check_prompt_size(self.tokenizer, prompt, self.llm.max_model_len)
            try:
                requested = frozenset(request.requested_output_names())
            except Exception:
                requested = None
            state = StreamState(rid, req, sender, arrival=arrival, requested=requested or None)
            self.responder.register(state)
            submitted = True
            try:
                if req.embedding is not None:
                    self.engine.add_embedding(rid, prompt, req.embedding.dimensions,
                                              sink=self.responder)
                else:
                    self.engine.add_request(rid, prompt, req.params, sink=self.responder)
            except EngineUnavailable as e:  # shutting down, or a TP group being rebuilt
                self.responder.unregister(rid)
                self.responder.send_error(sender, str(e),
                                          getattr(pb.TritonError, "UNAVAILABLE", None))
                submitted = False
        except ValueError as e:
            self.responder.unregister(rid)
            self._reject(sender, str(e))
        except Exception:
            log.exception("request %s: internal error while reading or submitting it", rid)
            self.responder.unregister(rid)
            self.metrics.request_finished("error", None, 0, 0)
            self.responder.send_error(
                sender, f"internal error: the request could not be processed (request id "
                        f"{rid}; the server log has the details)",
                getattr(pb.TritonError, "INTERNAL", None))
        else:  # submitted: counted once, never a second answer
            if self.lora_requests is not None and submitted:
                self.lora_requests.count(req.params.lora_name)

    def _reject(self, sender, message: str) -> None:
        if len(message) > MAX_ERROR_CHARS:  # some messages quote the client's value
            message = message[:MAX_ERROR_CHARS] + " ..."
        log.info("invalid request: %s", message)
        self.metrics.request_finished("invalid", None, 0, 0)
        self.responder.send_error(sender, message, getattr(self.pb.TritonError, "INVALID_ARG", None))

    # ---- unload -------------------------------------------------------------------------------
    # The unload has a deadline: tritonserver's --exit-timeout-secs counts from the signal until
    # the stub process has exited. After our last stream ends, the Python backend sleeps 1 s (its
    # stub health check) before it calls finalize(), then waits for the stub to exit. So the
    # engine is torn down as soon as the streams have ended (overlapping that sleep), and the
    # stub leaves without the interpreter's teardown (backend/process_exit.py).
    def _on_signal(self, signum: int) -> None:
        """The server is stopping: refuse new requests, let in-flight ones finish for the grace
        period, end the rest with an error, so Triton can unload the model (-> finalize), and
        tear the engine down meanwhile."""
        if self._stopping:
            return
        self._stopping = True
        grace = grace_seconds()
        log.info("signal %d: draining %d request(s) for up to %.0fs", signum,
                 len(self.responder.active), grace)

        def drain():
            deadline = time.monotonic() + grace
            while self.responder.active and time.monotonic() < deadline:
                time.sleep(0.05)
            n = self.responder.abort_all("request aborted: the server is shutting down")
            if n:
                log.info("aborted %d request(s) still in flight", n)
            self._teardown()
        threading.Thread(target=drain, name="drain", daemon=True).start()

    def _teardown(self) -> None:
        """Stop the engine thread (in-flight requests get a final error), the response thread
        and the tensor-parallel workers. Idempotent; a second caller waits for the first."""
        with self._teardown_lock:
            if self._torn_down:
                return
            self._stopping = True
            log.info("unloading: %d request(s) in flight", len(self.responder.active))
            self.engine.shutdown()  # in-flight requests get a final 'abort' output with an error
            self.responder.stop()
            self.llm.close()  # tensor-parallel workers
            _stop_resource_tracker()
            self._torn_down = True
            log.info("unloaded; %s", self.responder.delivery_summary())

    def finalize(self) -> None:
        self._teardown()
        if self._in_stub:
            # The stub acknowledged finalize before calling it; the Python backend now only waits
            # for the process to exit, within tritonserver's exit timeout. Everything that
            # outlives the process was released above (workers reaped, shared memory unlinked,
            # resource tracker stopped); the parent unlinks the stub's own region.
            exit_now(0)


def _stop_resource_tracker() -> None:
    """Tensor parallelism started multiprocessing's resource tracker as a child of this stub.
    Stop and reap it now: left alone it exits only after the stub, reparented to PID 1, and stays a
    zombie where PID 1 does not reap (containers)."""
    try:
        from multiprocessing import resource_tracker
        tracker = resource_tracker._resource_tracker
        if getattr(tracker, "_fd", None) is not None:
            tracker._stop()  # closes its pipe (it unlinks what is still registered) and waits
    except Exception as e:  # a private API: never fail the unload over it
        log.debug("resource tracker not stopped: %s", e)
