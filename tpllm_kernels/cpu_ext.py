"""Builds and loads the fused C++ CPU kernels in tpllm_kernels/csrc, one module per x86 ISA level,
and picks the best level the running CPU supports when the module loads (as ATen dispatches its own
CPU kernels), instead of building for the build host's CPU (-march=native).

Variants (best first): avx512_bf16 (x86-64-v4 + AVX512-BF16 and VNNI: the bf16 GEMV's vdpbf16ps,
the int8 head screen's vpdpbusd), avx512 (x86-64-v4), avx2 (x86-64-v3: AVX2 + FMA + F16C). The
same sources build every variant: the kernels are written once against vec.h's 16-lane vector (one AVX-512 register or two AVX2
ones) and compute the same float32 bits on each (the bf16 GEMV differs: vdpbf16ps vs widened
FMAs). `make setup` (python -m tpllm_kernels.cpu_ext) builds only the variant this CPU runs: the
others cannot be loaded here, and each costs a compile. A variant missing at load is built
then (the tests that force another runnable variant build it on first use). `python -m
tpllm_kernels.cpu_ext all` builds every x86 variant, whatever CPU it runs on, so an image built on
one host runs at full speed on another (the Dockerfile does). A CPU without AVX2 + FMA (or a
non-x86 one) gets the portable "generic" build.

Each build is cached under the project cache dir, keyed by the sources, the variant's flags
and the torch and Python versions (not by the host's CPU). Without a compiler the engine keeps
the torch reference path and says so.

Environment:
  TPLLM_CPU_KERNELS=0      the torch reference path (no C++ kernels)
  TPLLM_REQUIRE_CPU_KERNELS=1  (`make test`) a failed build is an error, not the fallback
  TPLLM_CPU_ISA=<variant>  force a variant (avx2, avx512, avx512_bf16, generic); one the CPU
                           cannot run is refused with an error, never run
  MAX_JOBS=<n>             parallel compile jobs (default: one per core; the sources build as
                           2 units, each job up to ~1 GB)
`isa_level()` names the variant this process loaded (benchmarks print it).
"""
from __future__ import annotations

import fcntl
import hashlib
import inspect
import logging
import os
import platform
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tpllm_kernels.cache_dir import cache_root

log = logging.getLogger("tpllm_kernels")
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))  # one module; headers (*.h) are included by them
# The sources compile as two translation units ("unity" builds: each #includes several of them).
# torch's and pybind11's headers are most of a source's compile time, so a variant parses them
# twice instead of once per source: about a third of the compiler time (docs/decisions.md, "The
# kernels build as two translation units"). Two units, one per core of the small hosts this
# targets: the pybind-heavy sources, and the rest.
# The sources of a unit share its anonymous namespace: a name two of them define there is a
# compile error, and a source whose anonymous namespace has a using-directive (it would reach
# the sources after it) goes last in its unit.
_UNIT_OF_BINDINGS = ("bindings.cpp", "thread_team_bindings.cpp", "decode_layer.cpp")
_LAST_IN_UNIT = ("prefill_attention.cpp",)
# fp-contract off: no fused multiply-adds but the kernels' explicit ones, so results match the
# torch reference bit for bit where the arithmetic is the same, and every variant matches the
# others (the explicit FMAs are the same on each)
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
# -fopenmp: at::parallel_for is an inline OpenMP loop, compiled into this module; without the flag
# it silently runs on one thread. The module links libgomp.so.1 by soname, so the process keeps
# the single runtime torch already loaded (its thread pool and torch.set_num_threads apply).
_LDFLAGS = ["-fopenmp"]
ISA_ENV = "TPLLM_CPU_ISA"

_V2 = ("sse4_2", "sse4_1", "ssse3", "popcnt", "cx16")
_V3 = _V2 + ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "xsave")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclass(frozen=True)
class Variant:
    name: str  # the TPLLM_CPU_ISA value and the module's suffix
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the code may use

    @property
    def module(self) -> str:
        return f"tpllm_cpu_kernels_{self.name}"


X86_VARIANTS = (  # best first
    # every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids on, Zen 4 and 5) has VNNI too:
    # the int8 head screen's vpdpbusd (csrc/q8_head_screen.cpp)
    Variant("avx512_bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
            _V4 + ("avx512_bf16", "avx512_vnni")),
    Variant("avx512", ("-march=x86-64-v4",), _V4),
    Variant("avx2", ("-march=x86-64-v3",), _V3),
)
GENERIC = Variant("generic", (), ())  # the portable code: the compiler's default target
_IS_X86 = platform.machine().lower() in ("x86_64", "amd64")


def variants() -> tuple[Variant, ...]:
    """Every variant this architecture has, best first."""
    return (*X86_VARIANTS, GENERIC) if _IS_X86 else (GENERIC,)


def _variant(name: str) -> Variant:
    for v in variants():
        if v.name == name:
            return v
    raise ValueError(f"{ISA_ENV}={name!r}: must be one of "
                     f"{', '.join(v.name for v in variants())}")


def cpuinfo_field(name: str) -> str | None:
    """The value of the first /proc/cpuinfo line starting with `name` (Linux), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next(line for line in f if line.startswith(name))
        return line.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return None


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The running CPU's feature flags (Linux /proc/cpuinfo; else what torch's own dispatch
    detected, which cannot tell AVX512-BF16)."""
    line = cpuinfo_field("flags")
    if line is not None:
        return frozenset(line.split())
    import torch
    cap = torch.backends.cpu.get_cpu_capability()
    return frozenset(_V4 if cap.startswith("AVX512") else _V3 if cap == "AVX2" else ())


def cpu_vendor() -> str:
    """The running CPU's vendor id (GenuineIntel, AuthenticAMD, ...; "" where there is none to
    read)."""
    return cpuinfo_field("vendor_id") or ""


def can_run(v: Variant) -> bool:
    return set(v.cpu_flags) <= cpu_flags()


def runnable() -> list[str]:
    """The variants this CPU can run, best first."""
    return [v.name for v in variants() if can_run(v)]


def selected_variant() -> Variant:
    """TPLLM_CPU_ISA's variant if the CPU can run it (else an error), or the best it can run."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        v = _variant(forced)
        if not can_run(v):
            missing = sorted(set(v.cpu_flags) - cpu_flags())
            raise RuntimeError(f"{ISA_ENV}={forced}: this CPU cannot run the {forced} kernels "
                               f"(missing {', '.join(missing)}); it can run "
                               f"{', '.join(runnable())}")
        return v
    return next(v for v in variants() if can_run(v))


def _cache_dir(v: Variant) -> Path:
    import torch
    # The source directory is part of the key: build.ninja names the sources by absolute path, so
    # two checkouts sharing one cache dir would rebuild each other's module on every load.
    sources = str(_CSRC).encode() + b"".join(
        p.read_bytes() for p in _SOURCES + sorted(_CSRC.glob("*.h")))
    sources += repr(_units()).encode()
    flags = " ".join(_CFLAGS + list(v.cflags) + _LDFLAGS)
    key = hashlib.sha256(sources + torch.__version__.encode() + sys.version.encode()
                         + flags.encode()).hexdigest()[:16]
    return cache_root() / "cpu_kernels" / f"{v.name}-{key}"


def _cores() -> int:
    """The cores this process may run on (its affinity mask, as a container limits it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _units() -> list[list[str]]:
    """The sources' names by translation unit, in include order."""
    first = [n for n in _UNIT_OF_BINDINGS if (_CSRC / n).exists()]
    rest = [p.name for p in _SOURCES if p.name not in first and p.name not in _LAST_IN_UNIT]
    return [first, rest + [n for n in _LAST_IN_UNIT if (_CSRC / n).exists()]]


def _write_units(build_dir: Path) -> list[str]:
    """The unit sources in build_dir. Written only when missing or different (ninja rebuilds
    what is newer than its object), and by rename (another process may be compiling them)."""
    paths = []
    for i, names in enumerate(_units()):
        path = build_dir / f"unit_{i}.cpp"
        text = "".join(f'#include "{_CSRC / n}"\n' for n in names)
        if not path.exists() or path.read_text() != text:
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
        paths.append(str(path))
    return paths


def _prepare(v: Variant) -> dict:
    """cpp_extension's build arguments for variant v (its build dir created)."""
    build_dir = _cache_dir(v)
    build_dir.mkdir(parents=True, exist_ok=True)
    # ninja may live beside the interpreter (a venv) without being on PATH
    bindirs = {str(Path(sys.executable).parent), str(Path(sys.prefix) / "bin")}
    os.environ["PATH"] = os.pathsep.join([*bindirs, os.environ.get("PATH", "")])
    # one compile job per core: ninja's default (cores + 2) only adds memory (a unit's job
    # needs up to ~1 GB) on the small hosts this targets
    os.environ.setdefault("MAX_JOBS", str(_cores()))
    return dict(name=v.module, sources=_write_units(build_dir),
                # copies: cpp_extension appends torch's libraries to extra_ldflags in place, which
                # changed this module's _LDFLAGS, hence every later cache key in the process
                extra_cflags=_CFLAGS + list(v.cflags), extra_ldflags=list(_LDFLAGS),
                build_directory=str(build_dir), verbose=False)


@contextmanager
def _exclusive(build_dir: Path):
    """One builder per build dir across processes. torch's own lock is a file in the build dir
    that a killed build leaves behind, after which every later load of that variant waits for it
    forever (seen here: a server start stuck until its test's timeout). A flock is released by
    the kernel when its holder dies; whoever holds it is the only builder, so a torch lock file
    found then is stale and goes."""
    with open(build_dir / ".build.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def build(name: str) -> Path:
    """Compiles variant `name` without loading it (the CPU need not run it); returns its dir."""
    from torch.utils import cpp_extension
    v = _variant(name)
    args = _prepare(v)
    with _exclusive(Path(args["build_directory"])):
        if can_run(v):
            cpp_extension.load(**args)
        else:  # compile only: importing code for another ISA may execute its instructions
            fn = cpp_extension._write_ninja_file_and_build_library
            params = inspect.signature(fn).parameters
            extra = dict(extra_cuda_cflags=None, extra_sycl_cflags=None,
                         extra_include_paths=None, with_cuda=False, with_sycl=False)
            fn(**args, **{k: val for k, val in extra.items() if k in params})
    return Path(args["build_directory"])


_loaded: str | None = None  # the variant load() returned


@lru_cache(maxsize=1)
def load():
    """The extension module of the selected variant, or None (disabled, or no working compiler).
    Raises if TPLLM_CPU_ISA names a variant this CPU cannot run."""
    global _loaded
    if os.environ.get("TPLLM_CPU_KERNELS", "1") == "0":
        return None
    v = selected_variant()
    from torch.utils import cpp_extension
    args = _prepare(v)
    if not any(Path(args["build_directory"]).glob("*.so")):
        log.info("building the C++ CPU kernels (%s, one time) in %s", v.name,
                 args["build_directory"])
    try:
        with _exclusive(Path(args["build_directory"])):
            module = cpp_extension.load(**args)
    except Exception as e:  # no compiler / headers: the torch path still works
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if os.environ.get("TPLLM_REQUIRE_CPU_KERNELS") == "1":  # `make test`/CI: no silent fallback
            raise RuntimeError(f"C++ CPU kernels failed to build ({reason}) and "
                               "TPLLM_REQUIRE_CPU_KERNELS=1") from e
        log.warning("C++ CPU kernels unavailable (%s); using the torch reference path", reason)
        return None
    _loaded = v.name
    log.info("C++ CPU kernels: %s variant", v.name)
    return module


def isa_level() -> str:
    """The kernel variant this process runs ('avx512_bf16', 'avx512', 'avx2', 'generic'), or
    'none (torch reference)' when the C++ kernels are off or could not be built."""
    load()
    return _loaded or "none (torch reference)"


def _build_names(argv: list[str]) -> list[str]:
    """No argument: the variant this process will load; `all`: every variant of this architecture
    but the generic one (which only a CPU without AVX2 loads, building it then); else the named
    ones."""
    if not argv:
        return [selected_variant().name]
    if argv == ["all"]:
        return [v.name for v in variants() if v is not GENERIC or not _IS_X86]
    return [_variant(name.lower()).name for name in argv]


def main(argv: list[str]) -> int:
    """Builds the kernels (`_build_names`), saying what and how long each took, then loads the
    selected variant."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = _build_names(argv)
    jobs = os.environ.get("MAX_JOBS") or _cores()
    print(f"C++ CPU kernels: building {', '.join(names)} with {jobs} parallel jobs (this CPU runs "
          f"{selected_variant().name}; it can run {', '.join(runnable())})", flush=True)
    failed, start = [], time.monotonic()
    for name in names:
        t0 = time.monotonic()
        try:
            where = build(name)
            print(f"  {name}: {time.monotonic() - t0:.0f} s ({where})", flush=True)
        except Exception as e:
            log.warning("C++ CPU kernels: %s failed (%s)", name, str(e).splitlines()[0] if str(e)
                        else type(e).__name__)
            failed.append(name)
    if load() is None:
        return 1
    print(f"C++ CPU kernels: done in {time.monotonic() - start:.0f} s; this process loads "
          f"{isa_level()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
