"""`python -m client perf_analyzer ...` / `python -m client genai-perf ...`: NVIDIA's own
benchmark tools, run unchanged, with the two shared libraries they need found for them.

The tritonclient 2.51.0 wheel (the server's release; `make setup` pins it) ships the
`perf_analyzer` binary, which links `libb64.so.0d` and `libcudart.so.12` (no GPU is needed, the
CUDA runtime only has to load). The nvidia-pytriton wheel that provides our tritonserver bundles
both under hashed names (`nvidia_pytriton.libs/libb64-<hash>.so.0d`, ...). This module makes a
directory of links with the plain names (under the project cache, never inside the venv), puts
it first on LD_LIBRARY_PATH and execs the tool: nothing else is changed, every argument is the
tool's own. genai-perf (its own venv, `make genai-perf`) calls `perf_analyzer` from PATH: it is
run with this venv's bin first on PATH and the same library path.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from tpllm_kernels.cache_dir import cache_root

# plain soname -> the glob of the hashed copy in nvidia_pytriton.libs/
NEEDED_LIBS = {"libb64.so.0d": "libb64-*.so.0d", "libcudart.so.12": "libcudart-*.so.12*"}
ROOT = Path(__file__).resolve().parents[1]
GENAI_PERF_VENV = ROOT / ".venv-genai-perf"  # made by `make genai-perf`
# The ready --input-data file: 1024-token prompt, max_tokens 64, ignore_eos, greedy, streaming.
INPUT_DATA = ROOT / "client" / "perf_data_1024_64.json"


def _find(own: Path, name: str, hint: str) -> Path:
    """`own` if it exists, else `name` on PATH, else exit with `hint`."""
    if own.exists():
        return own
    found = shutil.which(name)
    if found:
        return Path(found)
    sys.exit(f"{name} not found: {hint}")


def perf_analyzer_binary() -> Path:
    """The perf_analyzer of this environment (next to its Python, as pip installs it), else PATH."""
    return _find(Path(sys.executable).parent / "perf_analyzer", "perf_analyzer",
                 "`make setup` installs tritonclient[all]==2.51.0, whose wheel ships it "
                 "(later wheels do not)")


def _pytriton_libs() -> Path | None:
    spec = importlib.util.find_spec("pytriton")  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]).parent / "nvidia_pytriton.libs"
    return d if d.is_dir() else None


def library_dir() -> Path | None:
    """A directory holding links with the plain names to the bundled libraries (made once, kept
    in sync with the venv: a link to a missing file is replaced). None when pytriton is absent
    (e.g. NVIDIA's container, where the system provides the libraries)."""
    src = _pytriton_libs()
    if src is None:
        return None
    # One directory per venv (keyed by its libs path): venvs never relink each other's links.
    key = hashlib.sha1(str(src.resolve()).encode()).hexdigest()[:12]
    dest = cache_root() / "perf-analyzer-libs" / key
    dest.mkdir(parents=True, exist_ok=True)
    for name, pattern in NEEDED_LIBS.items():
        matches = sorted(glob.glob(str(src / pattern)))
        if not matches:
            continue
        link = dest / name
        if os.path.realpath(link) == os.path.realpath(matches[-1]) and link.exists():
            continue
        tmp = dest / f".{name}.tmp{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(matches[-1])
        os.replace(tmp, link)  # atomic: concurrent runs never see a missing link
    return dest


def tool_env(base: dict | None = None) -> dict:
    """The environment perf_analyzer (or genai-perf, which runs it) needs: the library links first
    on LD_LIBRARY_PATH, this venv's bin first on PATH."""
    env = dict(os.environ if base is None else base)
    libs = library_dir()
    if libs is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(perf_analyzer_binary().parent), env.get("PATH", "")))
    return env


def genai_perf_binary() -> Path:
    return _find(GENAI_PERF_VENV / "bin" / "genai-perf", "genai-perf",
                 f"run `make genai-perf` (installs genai-perf==0.0.16 in {GENAI_PERF_VENV.name}/: "
                 "it needs numpy<2 and its own dependency set)")


def main(args) -> int:
    exe = genai_perf_binary() if args.tool == "genai-perf" else perf_analyzer_binary()
    argv = [str(exe), *args.tool_args]
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(str(exe), argv, tool_env())
    return 0  # not reached
