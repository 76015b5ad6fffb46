"""Notice server shutdown inside the stub, so in-flight streams end and the model can unload.

The Python backend calls finalize() only after every decoupled request has sent its FINAL
response, and tritonserver never tells the stub it is stopping: a long stream would hold the
server until its exit timeout and a crash-exit. So the stub watches SIGINT/SIGTERM itself (a
terminal's Ctrl-C reaches the whole process group; `python -m backend.serve` forwards signals to
the stubs): Python's C-level handler writes to a wakeup fd at once, even while the stub's main
thread sits in C++, and a watcher thread turns that into `on_signal(signum)`.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger("backend.triton")


def grace_seconds() -> float:
    """How long in-flight requests may still finish after the signal (the launcher derives it
    from tritonserver's --exit-timeout-secs)."""
    try:
        return max(0.0, float(os.environ.get("TPLLM_SHUTDOWN_GRACE_SECS", "0")))
    except ValueError:
        return 0.0


def watch_signals(on_signal, signals=(signal.SIGINT, signal.SIGTERM)) -> bool:
    """Calls on_signal(signum) from a daemon thread at each of `signals`. False when it cannot be
    installed (not called from the main thread)."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for s in signals:
            signal.signal(s, lambda *_: None)  # a Python handler, so the C handler writes the fd
    except ValueError as e:
        log.warning("cannot watch shutdown signals (%s): streams end at the server's exit timeout", e)
        os.close(r), os.close(w)
        return False

    def run():
        while True:
            try:
                data = os.read(r, 16)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in signals:
                    try:
                        on_signal(signum)
                    except Exception:
                        log.exception("shutdown handler failed")
    threading.Thread(target=run, name="signal-watch", daemon=True).start()
    return True
