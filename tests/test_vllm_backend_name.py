"""Our model under the backend name "vllm" (Triton's OpenAI frontend allows logprobs only for
models whose config says `backend: "vllm"`): the one-line Python-based backend file, where
backend.serve and the Dockerfile put it, the clear failure when a config names the backend and
the file is missing or is NVIDIA's, and the repository override the server tests use. Nothing is
served here (tests/integration/test_vllm_backend_name_server.py serves it)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from backend import serve
from client.server import make_repo

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "backend" / "triton" / "python_backends" / "vllm" / "model.py"
VERSION_MODEL = ROOT / "model_repository" / "llm" / "1" / "model.py"
DOCKERFILE = (ROOT / "Dockerfile").read_text()
CONFIG = (ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()


def _imports(path: Path) -> list[str]:
    return [ast.dump(n) for n in ast.parse(path.read_text()).body
            if isinstance(n, (ast.Import, ast.ImportFrom))]


def _repo(tmp_path: Path, backend: str) -> Path:
    (tmp_path / "repo" / "llm" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "llm" / "config.pbtxt").write_text(f'backend: "{backend}"\n')
    return tmp_path / "repo"


def test_the_shim_is_the_model_the_python_backend_serves():
    assert serve.VLLM_SHIM == SHIM
    assert _imports(SHIM) == _imports(VERSION_MODEL) != []


def test_the_default_config_stays_python():
    assert re.findall(r'^backend: "([^"]*)"$', CONFIG, re.M) == ["python"]


def test_serve_backend_directory_has_vllm_model_py(tmp_path, monkeypatch):
    monkeypatch.setenv("TPLLM_CACHE_DIR", str(tmp_path / "cache"))
    server, dist = serve.find_tritonserver()
    if dist is None:
        pytest.skip("a system tritonserver: its own backends/ directory is used")
    out = serve.prepare_backend_dir(server, dist)
    assert (out / "vllm" / "model.py").read_text() == SHIM.read_text()
    assert (out / "python" / serve.STUB).exists()  # the stub a Python-based backend runs on
    serve.check_vllm_backend(_repo(tmp_path, "vllm"), server, out)  # no exit


def test_dry_run_with_a_vllm_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TPLLM_CACHE_DIR", str(tmp_path / "cache"))
    serve.main(["--model-repository", str(_repo(tmp_path, "vllm")), "--dry-run"])
    cmd = capsys.readouterr().err.splitlines()[0].split()
    if "--backend-directory" in cmd:
        backends = Path(cmd[cmd.index("--backend-directory") + 1])
        assert (backends / "vllm" / "model.py").read_text() == SHIM.read_text()


def test_vllm_config_without_the_shim_exits_clearly(tmp_path):
    server = tmp_path / "tritonserver" / "bin" / "tritonserver"
    backends = tmp_path / "tritonserver" / "backends"
    (backends / "python").mkdir(parents=True)
    serve.check_vllm_backend(_repo(tmp_path / "a", "python"), server, None)  # not asked: fine
    repo = _repo(tmp_path / "b", "vllm")
    with pytest.raises(SystemExit) as e:  # the server's own backends/ (a system install)
        serve.check_vllm_backend(repo, server, None)
    msg = str(e.value)
    assert 'model llm says backend: "vllm"' in msg and str(backends / "vllm" / "model.py") in msg
    assert str(SHIM) in msg
    (backends / "vllm").mkdir()
    (backends / "vllm" / "model.py").write_text("from vllm.engine import x  # NVIDIA's\n")
    with pytest.raises(SystemExit, match="another vllm backend.*vllm-python-py3"):
        serve.check_vllm_backend(repo, server, None)
    (backends / "vllm" / "model.py").write_text(SHIM.read_text())
    serve.check_vllm_backend(repo, server, None)
    with pytest.raises(SystemExit, match="does not exist"):  # an own --backend-directory
        serve.check_vllm_backend(repo, server, tmp_path / "empty")


def test_models_named_vllm_reads_the_field_not_comments(tmp_path):
    (tmp_path / "m" / "x").mkdir(parents=True)
    (tmp_path / "m" / "x" / "config.pbtxt").write_text('# backend: "vllm"\nbackend: "python"\n')
    (tmp_path / "m" / "y").mkdir()
    (tmp_path / "m" / "y" / "config.pbtxt").write_text('name: "y"\n  backend : "vllm"\n')
    assert serve.models_named_vllm(tmp_path / "m") == ["y"]


def test_make_repo_backend_override(tmp_path):
    named = (make_repo(tmp_path / "a", {"warmup": "false"}, backend="vllm")
             / "llm" / "config.pbtxt").read_text()
    assert re.findall(r'^backend: "([^"]*)"$', named, re.M) == ["vllm"]
    assert serve.models_named_vllm(tmp_path / "a") == ["llm"]
    default = (make_repo(tmp_path / "b", {}) / "llm" / "config.pbtxt").read_text()
    assert default == CONFIG


def test_dockerfile_installs_the_shim_and_names_the_backend_in_the_frontend_image():
    steps = re.split(r"\n(?=[A-Z]+ )", DOCKERFILE)
    [run] = [s for s in steps if "/opt/tritonserver/backends/vllm/model.py" in s
             and s.startswith("RUN ")]
    src = SHIM.relative_to(ROOT).as_posix()
    assert f"cp {src} /opt/tritonserver/backends/vllm/model.py" in run
    assert src.startswith("backend/") and re.search(r"^COPY backend backend$", DOCKERFILE, re.M)
    # NVIDIA's vLLM images already have a vllm backend there: the build refuses to overwrite it
    assert "if [ -e /opt/tritonserver/backends/vllm ]" in run and "exit 1" in run
    # the frontend image's served model names the backend; the sed must match the shipped line
    sed = re.search(r"""sed -i 's/(.*?)/(.*?)/' /models/llm/config.pbtxt""", run)
    assert '[ "$OPENAI_FRONTEND" = "1" ]' in run and sed
    assert re.sub(sed.group(1), sed.group(2), CONFIG, flags=re.M).count('backend: "vllm"') == 1
    # ... after the repository is copied in, and the step fails if it did not apply
    copy_repo = next(i for i, s in enumerate(steps) if s.startswith("COPY model_repository "))
    assert steps.index(run) > copy_repo
    assert "grep -qx 'backend: \"vllm\"' /models/llm/config.pbtxt" in run
