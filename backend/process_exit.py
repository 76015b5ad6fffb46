"""Ending a process without the interpreter's teardown, once nothing needs it.

Finalizing an interpreter that holds torch (module teardown, garbage collection, C++ static
destructors) took 5-14 s on a loaded 2-core machine (measured), and somebody waits for it: rank 0
joins its tensor-parallel workers, and tritonserver waits for each Python-backend stub within its
exit timeout. Callers release first what outlives the process (shared-memory names, child
processes); the kernel takes back the rest (mappings, sockets, threads).
"""
from __future__ import annotations

import logging
import os
import sys


def exit_now(code: int) -> None:
    """Flush the logs and standard streams, then end this process with `code`."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
