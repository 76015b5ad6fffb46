"""Run NVIDIA's tritonserver on a model repository with this project's Python environment.

    python -m backend.serve [--model-repository DIR] [--http-port P] [--grpc-port P]
                            [--metrics-port P] [-- extra tritonserver flags]

Finds `tritonserver` (on PATH, as in NVIDIA's container, else the one shipped in the
nvidia-pytriton wheel), prepares a Python-backend directory whose stub matches the running Python
(under $TPLLM_CACHE_DIR or ~/.cache/tp-llm, never inside the venv), plus vllm/model.py there (a
model config saying `backend: "vllm"` then serves our model under that name, which Triton's
OpenAI frontend requires for logprobs), sets the environment the stub needs and runs the server
as its child: SIGINT/SIGTERM are forwarded to it and to its Python-backend stubs (so in-flight
streams end and the models unload cleanly, see backend/triton/shutdown.py); the exit status is
the server's.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

from tpllm_kernels.cache_dir import cache_root

STUB = "triton_python_backend_stub"
# Our model as the Python-based backend "vllm" (Triton loads <backend-directory>/vllm/model.py for
# a config saying `backend: "vllm"`, with the python/ backend's stub): Triton's OpenAI frontend
# serves logprobs only to models whose config names that backend.
VLLM_SHIM = Path(__file__).resolve().parent / "triton" / "python_backends" / "vllm" / "model.py"


def _pytriton_dist() -> Path | None:
    spec = importlib.util.find_spec("pytriton")  # located, not imported (that is slow)
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    return d if (d / "bin" / "tritonserver").exists() else None


def find_tritonserver() -> tuple[Path, Path | None]:
    """(the tritonserver binary, the pytriton distribution dir or None for a system install)."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path), None
    for p in (Path("/opt/tritonserver/bin/tritonserver"),):
        if p.exists():
            return p, None
    dist = _pytriton_dist()
    if dist is None:
        sys.exit("tritonserver not found: install NVIDIA's container or `pip install nvidia-pytriton`"
                 " (make setup does)")
    return dist / "bin" / "tritonserver", dist


def _copy_if_changed(src: Path, dst: Path) -> None:
    if dst.exists() and dst.stat().st_size == src.stat().st_size and \
            dst.stat().st_mtime >= src.stat().st_mtime:
        return
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)  # atomic: concurrent launchers never see a half-written stub


def prepare_backend_dir(server: Path, dist: Path | None) -> Path | None:
    """A backends/ directory whose python/ holds the backend library and the stub built for this
    Python, and vllm/ our model as the "vllm" backend. None: use the server's own (a system
    install whose stub matches, e.g. the container, whose Dockerfile installs vllm/ there)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if dist is None:
        own = server.parent.parent / "backends" / "python"
        stub = own / STUB
        if (own / "libtriton_python.so").exists() and stub.exists():
            return None
        sys.exit(f"{own}: no Python backend next to {server}")
    src = dist / "backends" / "python"
    stub = dist / "python_backend_stubs" / version / STUB
    if not stub.exists():
        have = sorted(p.name for p in (dist / "python_backend_stubs").iterdir())
        sys.exit(f"nvidia-pytriton ships no Python-backend stub for Python {version} "
                 f"(it has {', '.join(have)}): use one of those Pythons for the venv")
    out = cache_root() / "triton-backends" / f"py{version}"
    (out / "python").mkdir(parents=True, exist_ok=True)
    for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
        _copy_if_changed(src / f, out / "python" / f)
    _copy_if_changed(stub, out / "python" / STUB)
    (out / "vllm").mkdir(exist_ok=True)
    _copy_if_changed(VLLM_SHIM, out / "vllm" / "model.py")
    return out


def models_named_vllm(repo: Path) -> list[str]:
    """The models of `repo` whose config.pbtxt says `backend: "vllm"`."""
    return [cfg.parent.name for cfg in sorted(repo.glob("*/config.pbtxt"))
            if re.search(r'^\s*backend\s*:\s*"vllm"', cfg.read_text(errors="replace"), re.M)]


def check_vllm_backend(repo: Path, server: Path, backend_dir: Path | None) -> None:
    """Exit with the fix when a model says `backend: "vllm"` and the backend directory lacks our
    vllm/model.py: Triton itself would only fail that model's load with "unable to find backend",
    or, with NVIDIA's vLLM backend in that place, start vLLM on a config it does not understand."""
    models = models_named_vllm(repo)
    if not models:
        return
    backends = backend_dir if backend_dir is not None else server.parent.parent / "backends"
    shim = backends / "vllm" / "model.py"
    which = (f'model {models[0]} says' if len(models) == 1 else
             f'models {", ".join(models)} say') + ' backend: "vllm"'
    if not shim.is_file():
        sys.exit(f"{which}, but {shim} does not exist: copy {VLLM_SHIM} there (the Dockerfile "
                 f'does), or set backend: "python"')
    if "backend.triton.adapter" not in shim.read_text(errors="replace"):
        sys.exit(f"{which}, but {shim} is another vllm backend than this project's (NVIDIA's "
                 f"vLLM backend, from a *-vllm-python-py3 image?): replace it with {VLLM_SHIM}, "
                 f"or build on a plain *-py3 image")


def server_env(dist: Path | None) -> dict[str, str]:
    """The stub embeds this Python: it must find this libpython first, this venv's interpreter
    first on PATH (how its sys.prefix, hence site-packages, is found: the stub runs Python
    isolated, PYTHONPATH is ignored), the wheel's bundled libraries, and a UTF-8 locale."""
    env = dict(os.environ)
    libs = [sysconfig.get_config_var("LIBDIR") or ""]
    if dist is not None:
        libs.append(str(dist.parent.parent / "nvidia_pytriton.libs"))
    old = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = ":".join([p for p in libs if p] + ([old] if old else []))
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["TPLLM_PYTHON"] = sys.executable  # for tensor-parallel workers spawned by the stub
    env.setdefault("LC_ALL", "C.UTF-8")
    env.setdefault("LANG", "C.UTF-8")
    env.setdefault("PYTHONUTF8", "1")
    # The C++ kernels' parallel loops (all of a decode step's) run on their own worker team
    # (tpllm_kernels/csrc/thread_team.h): bounded spinning, and no loop waits for a worker that has
    # not started. OpenMP is left to torch's own ops (the prefill GEMMs), where spinning threads
    # would starve the response thread (and other replicas) on shared cores: PASSIVE.
    env.setdefault("TPLLM_THREADING", "team")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (every thread's list)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(x) for x in task.read_text().split()]
        except OSError:
            pass
    return out


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the launcher dies (no orphaned server)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def run_server(cmd: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)

    def forward(signum, _frame):
        for pid in [proc.pid, *child_pids(proc.pid)]:  # the server and its stubs
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, forward)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # pragma: no cover - handlers replace the default
            continue


def build_command(args: argparse.Namespace, server: Path, backend_dir: Path | None) -> list[str]:
    cmd = [str(server), "--model-repository", str(Path(args.model_repository).resolve()),
           "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port),
           "--metrics-port", str(args.metrics_port),
           "--exit-timeout-secs", str(args.exit_timeout_secs)]
    if backend_dir is not None:
        cmd += ["--backend-directory", str(backend_dir)]
    if args.log_verbose:
        cmd += ["--log-verbose", str(args.log_verbose)]
    if not any(a.startswith("--allow-gpu-metrics") for a in args.extra) and not _has_gpus():
        # Without GPUs Triton's embedded DCGM only fails to start, and it logs that to
        # /var/log/nv-hostengine.log: outside anything this server should write to.
        cmd += ["--allow-gpu-metrics", "false"]
    return cmd + list(args.extra)


def _has_gpus(proc_dir: str = "/proc/driver/nvidia/gpus") -> bool:
    """An NVIDIA driver with at least one GPU (as backend.triton.placement.count_visible_gpus,
    which this launcher does not import: it pulls in torch)."""
    p = Path(proc_dir)
    return p.is_dir() and any(p.iterdir())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    root = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(prog="python -m backend.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model-repository", default=str(root / "model_repository"))
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--exit-timeout-secs", type=int, default=15,
                   help="on SIGINT/SIGTERM, how long the server waits for models to unload; "
                        "in-flight requests may finish for this minus 3 s (default 15)")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="print the command and environment")
    p.add_argument("extra", nargs="*", help="more tritonserver flags, after --")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    repo = Path(args.model_repository)
    if not repo.is_dir():
        sys.exit(f"{repo}: model repository not found")
    server, dist = find_tritonserver()
    backend_dir = prepare_backend_dir(server, dist)
    check_vllm_backend(repo, server, backend_dir)
    env = server_env(dist)
    env["TPLLM_SHUTDOWN_GRACE_SECS"] = str(max(0, args.exit_timeout_secs - 3))
    cmd = build_command(args, server, backend_dir)
    print("serve: " + " ".join(cmd), file=sys.stderr, flush=True)
    if args.dry_run:
        for k in ("LD_LIBRARY_PATH", "PATH", "TPLLM_PYTHON", "LC_ALL", "TPLLM_THREADING",
                  "TPLLM_SPIN_US", "OMP_WAIT_POLICY"):
            if k in env:
                print(f"  {k}={env[k]}", file=sys.stderr)
        return
    sys.exit(run_server(cmd, env))


if __name__ == "__main__":
    main()
