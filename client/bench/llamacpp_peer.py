"""llama.cpp beside our engine in one benchmark: a worker process in llama.cpp's own venv
(`make llamacpp`; llamacpp_worker.py) that the bench drives request by request, so rounds of the
two systems can alternate on the same prompts and threads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("llamacpp_worker.py")
REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / ".venv-llamacpp"


class LlamaCppUnavailable(RuntimeError):
    pass


def venv_python(venv: str | Path | None = None) -> Path:
    """The llama.cpp venv's interpreter: `venv`, else $TPLLM_LLAMACPP_VENV, else the
    repository's .venv-llamacpp."""
    root = Path(venv or os.environ.get("TPLLM_LLAMACPP_VENV") or DEFAULT_VENV)
    py = root / "bin" / "python"
    if not py.exists():
        raise LlamaCppUnavailable(
            f"no llama.cpp venv at {root}: run `make llamacpp` (builds llama-cpp-python for this "
            "CPU, several minutes) or set TPLLM_LLAMACPP_VENV")
    return py


class LlamaCppPeer:
    """One llama.cpp model loaded in a worker process; `generate` runs one request.

    If the worker dies of a signal in its first request, the model is loaded again without
    llama.cpp's extra buffer types and the request is retried once: on an AMX host (an Intel
    Xeon, AVX-512 with AMX-INT8) llama-cpp-python 0.3.36's native build segfaults in
    ggml_backend_amx_mul_mat on the default model's GGUF, and a user of that build would have to
    run it so. On x86 those buffer types are AMX and repacking, and ggml repacks neither Q4_1 nor
    Q8_0 there, so what remains is llama.cpp's own AVX-512 / AVX2 path. `fallback` then says so
    (None otherwise); the report prints it."""

    def __init__(self, gguf: str | Path, threads: int, n_ctx: int, venv: str | Path | None = None):
        self._argv = [str(venv_python(venv)), str(WORKER), str(gguf), str(threads), str(n_ctx)]
        self.fallback: str | None = None
        self._served = 0
        self._start()

    def _start(self, *extra: str) -> None:
        self.proc = subprocess.Popen(self._argv + list(extra), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.info = self._call({"op": "info"})

    def _call(self, req: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            line = ""
        else:
            line = self.proc.stdout.readline()
        if not line:
            raise LlamaCppUnavailable(f"the llama.cpp worker exited (rc {self.proc.wait()})")
        return json.loads(line)

    def generate(self, prompt: list[int], n: int) -> dict:
        """{"ttft_s", "e2e_s", "token_ids"}: exactly n greedy tokens after `prompt`."""
        req = {"op": "generate", "prompt": list(prompt), "n": n}
        try:
            got = self._call(req)
        except LlamaCppUnavailable:
            rc = self.proc.returncode
            if self._served or self.fallback is not None or rc is None or rc >= 0:
                raise
            self.fallback = (f"its first request died of signal {-rc}; it runs with "
                             "use_extra_bufts off (no AMX / repacked matmuls)")
            for pipe in (self.proc.stdin, self.proc.stdout):  # the dead worker's
                try:
                    pipe.close()
                except OSError:  # unflushed input to a closed pipe
                    pass
            self._start("no-extra-bufts")
            got = self._call(req)
        self._served += 1
        return got

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._call({"op": "quit"})
            except (OSError, LlamaCppUnavailable, json.JSONDecodeError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> "LlamaCppPeer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def isa_line(system_info: str) -> str:
    """The instruction sets llama.cpp's build uses, from its system info ("AVX512 = 1 | ...")."""
    on = []
    for kv in system_info.split("|"):  # "CPU : SSE3 = 1 | SSSE3 = 1 | ..."
        key, _, value = kv.partition("=")
        key = key.rpartition(":")[2].strip()
        if value.strip() == "1" and key.isupper():
            on.append(key)
    return ", ".join(on) or system_info.strip()


if __name__ == "__main__":  # a smoke check: python -m client.bench.llamacpp_peer GGUF
    with LlamaCppPeer(sys.argv[1], 2, 256) as peer:
        print(peer.info)
        print(peer.generate([1, 2, 3, 4], 4))
