"""Run the real tritonserver (via `python -m backend.serve`) on free ports with a temporary copy
of model_repository/ (parameters overridden): used by the integration tests and the serving
benchmarks. The server gets its own session so stop() can always kill everything it started."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = float(os.environ.get("TPLLM_TEST_SERVER_TIMEOUT", "240"))
# How long after its last step a server's llm_* counters are sure to include it: the response
# thread refreshes them every 0.1 s while busy and, idle, after each 0.5 s wait on its queue
# (backend/triton/responder.py). A 0.3 s wait read a previous round's tail as this one's.
COUNTERS_SETTLE_S = 1.0


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def make_repo(dest: Path, params: dict[str, str], count: int = 1,
              backend: str | None = None) -> Path:
    """A copy of model_repository/ with `params` and the instance count replaced, and the
    `backend` named (e.g. "vllm": our model as Triton's Python-based backend of that name, which
    backend.serve provides) when given."""
    shutil.copytree(ROOT / "model_repository", dest,
                    ignore=shutil.ignore_patterns("__pycache__"))
    cfg = dest / "llm" / "config.pbtxt"
    text = cfg.read_text()
    for key, value in params.items():
        pat = re.compile(r'(parameters \{ key: "%s" value: \{ string_value: )"[^"]*"' % key)
        text, n = pat.subn(r'\1"%s"' % value, text)
        if not n:
            text += f'\nparameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
    text, n = re.subn(r"count: \d+ kind: KIND_CPU", f"count: {count} kind: KIND_CPU", text)
    assert n == 1
    if backend is not None:
        text, n = re.subn(r'^backend: "[^"]*"$', f'backend: "{backend}"', text, flags=re.M)
        assert n == 1
    cfg.write_text(text)
    return dest


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def _series_total(scraped: dict[str, float], name: str, labels: dict[str, str] | None = None
                  ) -> float:
    """Sum of `name` over the scraped series ({'name{labels}': value}) matching `labels`;
    KeyError when none does."""
    values = []
    for key, v in scraped.items():
        base, _, lab = key.partition("{")
        if base == name and all(f'{k}="{val}"' in lab for k, val in (labels or {}).items()):
            values.append(v)
    if not values:
        raise KeyError(f"no metric series {name}{labels or ''} exported")
    return sum(values)


class Server:
    def __init__(self, repo: Path, log_path: Path, extra: list[str] = (), env: dict | None = None,
                 wrap: list[str] = ()):
        """`env`: the launcher's environment (default: this one); `wrap`: a command prefix
        (e.g. strace) for the launcher."""
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.log_path = log_path
        cmd = [*wrap, sys.executable, "-m", "backend.serve", "--model-repository", str(repo),
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
               "--metrics-port", str(self.metrics_port), *extra]
        self._log = open(log_path, "wb")
        # Own session: the launcher execs tritonserver, whose stubs share its process group.
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
        self.pgid = self.proc.pid

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited ({self.proc.returncode}):\n{self.log()}")
            if _get(f"http://{self.http_url}/v2/models/llm/ready", 2)[0] == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"tritonserver not ready after {timeout:.0f}s:\n{self.log()}")

    def ready(self) -> bool:
        return _get(f"http://{self.http_url}/v2/models/llm/ready", 5)[0] == 200

    def metrics(self, prefix: str = "llm_") -> dict[str, float]:
        """{'name{labels}': value} of the llm_* metrics (Triton's own: prefix "nv_")."""
        status, text = _get(f"http://localhost:{self.metrics_port}/metrics")
        assert status == 200
        out = {}
        for line in text.splitlines():
            if line.startswith(prefix):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric(self, name: str, default: float | None = None, **labels) -> float:
        """Sum of `name` over the series matching `labels`. No such series raises KeyError (a
        renamed or never-exported metric must not read as 0), unless a `default` is given: for
        series that appear at their first event (llm_requests_total per finish_reason)."""
        try:
            return _series_total(self.metrics(name.split("_", 1)[0] + "_"), name, labels)
        except KeyError:
            if default is None:
                raise
            return default

    def settled_metrics(self, names: tuple[str, ...], quiet: float = 0.7,
                        timeout: float = 15.0) -> dict[str, float]:
        """{name: value} of `names` (summed over labels) from one scrape, once two scrapes
        `quiet` s apart agree. For counters read together after the requests behind them have
        ended: the model refreshes them from the engine at least every 0.5 s while idle, so a
        single read may still hold an earlier refresh's values, and two reads at different
        times mix two refreshes. A name with no series exported raises KeyError, as metric()."""
        def scrape() -> dict[str, float]:
            got = self.metrics(names[0].split("_", 1)[0] + "_")
            return {n: _series_total(got, n) for n in names}
        deadline = time.monotonic() + timeout
        last = scrape()
        while True:
            time.sleep(quiet)
            now = scrape()
            if now == last or time.monotonic() > deadline:
                return now
            last = now

    def wait_metric(self, name: str, pred, timeout: float = 10.0, **labels) -> float:
        """The metric's value once `pred` holds for it, or at the timeout (a series that does
        not exist yet counts as not yet; still none at the timeout raises KeyError)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                v = self.metric(name, **labels)
                if pred(v):
                    return v
            except KeyError:
                if time.monotonic() > deadline:
                    raise
            else:
                if time.monotonic() > deadline:
                    return v
            time.sleep(0.1)

    def group_alive(self) -> list[int]:
        """pids still in the server's process group."""
        pids = []
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    if os.getpgid(int(p.name)) == self.pgid:
                        pids.append(int(p.name))
                except (ProcessLookupError, PermissionError):
                    pass
        return pids

    def stop(self, sig=signal.SIGINT, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.pgid, signal.SIGKILL)  # stubs or a hung server: never leave them
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log.close()


class BenchServer:
    """A ready tritonserver over a throwaway copy of model_repository/ with `params` set (and
    `model`, an HF directory, when given): what the serving benchmarks start. stop() removes
    the copy too."""

    def __init__(self, params: dict[str, str], model: str | None = None, prefix: str = "tpllm-bench-"):
        import tempfile
        if model:
            params = {**params, "model": str(Path(model).resolve())}
        self._dir = tempfile.TemporaryDirectory(prefix=prefix)
        d = Path(self._dir.name)
        self.server = Server(make_repo(d / "repo", params), d / "server.log")
        try:
            self.server.wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.server.stop()
        self._dir.cleanup()
