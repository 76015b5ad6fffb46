"""Builds (once) and loads the fused C++ CPU kernels in kernels/csrc (one module).

The build is cached under the project cache dir, keyed by the source, torch version and CPU
flags, so it happens at `make setup` (python -m kernels.cpu_ext) or the first start, never per
process. Without a compiler the engine keeps the torch reference path and says so.
Set TPLLM_CPU_KERNELS=0 to force the reference path.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("kernels")
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))  # one module; headers (*.h) are included by them
# fp-contract off: no fused multiply-adds, so results match the torch reference bit for bit
# where the arithmetic is the same
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
# -fopenmp: at::parallel_for is an inline OpenMP loop, compiled into this module; without the flag
# it silently runs on one thread. The module links libgomp.so.1 by soname, so the process keeps
# the single runtime torch already loaded (its thread pool and torch.set_num_threads apply).
_LDFLAGS = ["-fopenmp"]


def _cache_dir() -> Path:
    import torch
    flags = ""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    # The source directory is part of the key: build.ninja names the sources by absolute path, so
    # two checkouts sharing one cache dir would rebuild each other's module on every load.
    sources = str(_CSRC).encode() + b"".join(
        p.read_bytes() for p in _SOURCES + sorted(_CSRC.glob("*.h")))
    key = hashlib.sha256(sources + torch.__version__.encode() + flags.encode() + sys.version.encode()
                         + " ".join(_CFLAGS + _LDFLAGS).encode()).hexdigest()[:16]
    # The project's cache convention (see backend.model.gguf_import.cache_root); kernels/ sits
    # below backend/ and may not import it.
    root = os.environ.get("TPLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "tp-llm")
    return Path(root).expanduser() / "cpu_kernels" / key


@lru_cache(maxsize=1)
def load():
    """The extension module, or None (disabled, or no working compiler)."""
    if os.environ.get("TPLLM_CPU_KERNELS", "1") == "0":
        return None
    from torch.utils import cpp_extension
    build_dir = _cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    # ninja may live beside the interpreter (a venv) without being on PATH
    bindirs = {str(Path(sys.executable).parent), str(Path(sys.prefix) / "bin")}
    os.environ["PATH"] = os.pathsep.join([*bindirs, os.environ.get("PATH", "")])
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        log.info("building the C++ CPU kernels (one time) in %s", build_dir)
    try:
        return cpp_extension.load(name="tpllm_cpu_kernels", sources=[str(p) for p in _SOURCES],
                                  extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
                                  build_directory=str(build_dir),
                                  verbose=False)
    except Exception as e:  # no compiler / headers: the torch path still works
        log.warning("C++ CPU kernels unavailable (%s); using the torch reference path",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if load() is not None else 1)
