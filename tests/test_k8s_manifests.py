"""deploy/kubernetes/: every manifest parses and is valid against Kubernetes' own schemas (the
ones kubernetes-validate bundles: no cluster, no network), and agrees with what it deploys: the
Dockerfile's image (command, model repository, ports), backend/serve.py's ports, Triton's health
endpoints, config.pbtxt's "${...}" parameters read from the pod's environment, and the node
launcher's command line. Plus the environment substitution of model_config.py itself."""
from __future__ import annotations

import copy
import json
import os
import re
import signal
import stat
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from backend import serve
from backend.engine.tp import node  # the code behind `python -m backend.parallel.node`
from backend.engine.tp.channel import AUTHKEY_ENV
from backend.triton.model_config import parse_parameters, parameter_values

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
CONFIG = (ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
DOCKERFILE = (ROOT / "Dockerfile").read_text()
# the oldest Kubernetes release still maintained upstream when this was written, and the newest
# whose schemas the pinned kubernetes-validate ships
K8S_VERSIONS = ("1.31.0", "1.37.0")
# What the served default model measured (deploy/kubernetes/README.md, "Sizing"): the limits
# must leave it room.
MEASURED_RSS_GIB = 3.95


def _docs() -> dict[str, list[dict]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d]
            for p in sorted(DEPLOY.glob("*.yaml"))}


def _one(kind: str, name: str | None = None) -> dict:
    found = [d for docs in _docs().values() for d in docs
             if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, found)
    return found[0]


def _container(workload: dict) -> dict:
    [c] = workload["spec"]["template"]["spec"]["containers"]
    return c


def _serve_ports() -> dict[str, int]:
    a = serve.parse_args([])
    return {"http": a.http_port, "grpc": a.grpc_port, "metrics": a.metrics_port}


def _dockerfile_cmd() -> list[str]:
    return json.loads(re.search(r"^CMD (\[.*\])$", DOCKERFILE, re.M).group(1))


def _env(container: dict) -> dict[str, dict | str]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


# ---- the schema ------------------------------------------------------------------------------
def test_every_manifest_is_valid_kubernetes():
    docs = _docs()
    assert set(docs) == {"replicas.yaml", "tp-group.yaml"}
    kinds = sorted(d["kind"] for ds in docs.values() for d in ds)
    assert kinds == ["Deployment", "Service", "Service", "Service", "StatefulSet"]
    for name, ds in docs.items():
        for d in ds:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(d, version, strict=True)


def test_the_validator_rejects_what_kubernetes_would():
    """The check above can fail: a misspelled field and a wrong type are refused."""
    dep = _one("Deployment")
    typo = copy.deepcopy(dep)
    _container(typo)["readinesProbe"] = _container(typo).pop("readinessProbe")
    wrong = copy.deepcopy(dep)
    _container(wrong)["ports"][0]["containerPort"] = "8000"
    for bad in (typo, wrong):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


# ---- replicas --------------------------------------------------------------------------------
def test_replicas_run_the_image_as_the_dockerfile_does():
    dep = _one("Deployment")
    c = _container(dep)
    assert c["command"] == _dockerfile_cmd()
    repo = _dockerfile_cmd()[_dockerfile_cmd().index("--model-repository") + 1]
    assert re.search(rf"^COPY model_repository {re.escape(repo)}$", DOCKERFILE, re.M)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == _serve_ports()
    exposed = re.search(r"^EXPOSE (.*)$", DOCKERFILE, re.M).group(1).split()
    assert sorted(int(p) for p in exposed) == sorted(ports.values())


def test_replicas_probes_and_scrape():
    dep = _one("Deployment")
    c, pod = _container(dep), dep["spec"]["template"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    start = c["startupProbe"]
    assert start["httpGet"]["port"] == "http"
    # warm-up and a first start's kernel compile: minutes on a small CPU
    assert start["periodSeconds"] * start["failureThreshold"] >= 600
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == _serve_ports()["metrics"]
    assert ann["prometheus.io/path"] == "/metrics"
    # a server that unloads cleanly (backend.serve's --exit-timeout-secs) before SIGKILL
    exit_timeout = serve.parse_args([]).exit_timeout_secs
    assert pod["spec"]["terminationGracePeriodSeconds"] > exit_timeout


def test_replicas_service_and_sizing():
    dep, svc = _one("Deployment"), _one("Service", "tp-llm")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"] == labels
    assert svc["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]}
    assert ports == {n: (p, n) for n, p in _serve_ports().items()}
    res = _container(dep)["resources"]
    assert _gib(res["requests"]["memory"]) >= MEASURED_RSS_GIB
    assert _gib(res["limits"]["memory"]) >= _gib(res["requests"]["memory"])
    threads = _env(_container(dep))["TPLLM_NUM_THREADS"]
    assert float(res["limits"]["cpu"]) == int(threads)  # torch's threads = the CPU limit


def _gib(q: str) -> float:
    units = {"Gi": 1.0, "Mi": 1 / 1024}
    return float(q[:-2]) * units[q[-2:]]


# ---- the TP group across pods ------------------------------------------------------------------
def _run_script(script: str, hostname: str, env: dict[str, str], tmp_path: Path) -> list[str]:
    """Run a manifest's shell script with a fake `python3` that records its arguments."""
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / f"args-{hostname}"
    out.unlink(missing_ok=True)
    r = subprocess.run(["/bin/sh", "-c", script], env={
        **env, "HOSTNAME": hostname, "ARGS_OUT": str(out),
        "PATH": f"{fake.parent}:{os.environ['PATH']}"}, capture_output=True, text=True,
        timeout=30)
    assert r.returncode == 0, r.stderr
    return out.read_text().splitlines() if out.exists() else []


def _literal_env(container: dict) -> dict[str, str]:
    return {k: v for k, v in _env(container).items() if isinstance(v, str)}


def test_tp_group_pods_run_rank0_server_and_node_launchers(tmp_path, monkeypatch):
    sts = _one("StatefulSet")
    c = _container(sts)
    name = sts["metadata"]["name"]
    assert c["command"][:2] == ["/bin/sh", "-c"]
    env = _literal_env(c)
    rank0 = _run_script(c["command"][2], f"{name}-0", env, tmp_path)
    assert ["python3", *rank0] == _dockerfile_cmd()
    rank1 = _run_script(c["command"][2], f"{name}-1", env, tmp_path)
    assert rank1[:2] == ["-m", "backend.parallel.node"]
    # the launcher's own parser takes these arguments: rank = the pod's ordinal
    got = {}
    monkeypatch.setattr(node, "run_node", lambda opts, timeout: got.setdefault("opts", opts) and 0)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    monkeypatch.setenv(AUTHKEY_ENV, "k" * 32)
    assert node.main(rank1[2:]) == 0
    opts = got["opts"]
    assert opts.ranks == (1,) and opts.master_addr == env["MASTER_ADDR"]
    assert opts.master_port == int(env["MASTER_PORT"]) and opts.num_threads == int(
        env["TPLLM_NUM_THREADS"])


def test_tp_group_config_comes_from_the_pod_environment():
    """Rank 0's config.pbtxt (the image's) reads the StatefulSet's env: the group's size is the
    pod count, one rank per pod, the store on the headless Service's port."""
    sts, headless = _one("StatefulSet"), _one("Service", "tp-llm-tp")
    c = _container(sts)
    env = _literal_env(c)
    env["TPLLM_TP_MASTER_ADDR"] = "10.0.0.5"  # the downward API's status.podIP
    assert _env(c)["TPLLM_TP_MASTER_ADDR"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    kwargs, _ = parse_parameters({"parameters": _pbtxt_parameters()}, env)
    assert kwargs["tensor_parallel_size"] == sts["spec"]["replicas"]
    assert kwargs["tp_local_ranks"] == 1
    assert kwargs["tp_master_addr"] == "10.0.0.5"
    assert kwargs["num_threads"] == int(env["TPLLM_NUM_THREADS"])
    svc_ports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
    assert svc_ports == {"tp-store": kwargs["tp_master_port"],
                         "tp-steps": kwargs["tp_master_port"] + 1}  # channel.py: port + 1
    # every TPLLM_ variable the pod sets for config.pbtxt is one it reads (no typo goes unseen)
    referenced = set(re.findall(r"\$\{(\w+)", CONFIG))
    assert {k for k in _env(c) if k.startswith("TPLLM_") and k != AUTHKEY_ENV} <= referenced
    # the node launchers reach rank 0 by its stable name under the headless Service
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    assert env["MASTER_ADDR"] == f"{sts['metadata']['name']}-0.{headless['metadata']['name']}"
    assert env["MASTER_PORT"] == str(kwargs["tp_master_port"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True  # rank 0 waits for the others
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # OrderedReady would deadlock
    key = _env(c)[AUTHKEY_ENV]
    assert key["secretKeyRef"]["key"] and key["secretKeyRef"]["name"]


def test_tp_group_probes_and_client_service(tmp_path):
    sts, serving = _one("StatefulSet"), _one("Service", "tp-llm-tp-serve")
    c, name = _container(sts), sts["metadata"]["name"]
    http = _serve_ports()["http"]
    for probe, path in (("startupProbe", "ready"), ("readinessProbe", "ready"),
                        ("livenessProbe", "live")):
        script = c[probe]["exec"]["command"]
        assert script[:2] == ["/bin/sh", "-c"]
        # a node launcher's pod passes without asking anything; rank 0 asks Triton
        assert _run_script(script[2], f"{name}-1", {}, tmp_path) == []
        args = _run_script(script[2], f"{name}-0", {}, tmp_path)
        assert f"http://127.0.0.1:{http}/v2/health/{path}" in " ".join(args)
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= node.STARTUP_TIMEOUT_S
    assert serving["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == f"{name}-0"
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in serving["spec"]["ports"]}
    assert ports == {n: (p, p) for n, p in _serve_ports().items()}
    ann = sts["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == _serve_ports()["metrics"]


# ---- "${NAME}" in config.pbtxt ---------------------------------------------------------------------
def _pbtxt_parameters() -> dict:
    return {k: {"string_value": v} for k, v in re.findall(
        r'parameters \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}', CONFIG)}


def test_config_parameters_from_the_environment():
    params = {"tensor_parallel_size": {"string_value": "${TP:-2}"},
              "tp_master_addr": {"string_value": "${ADDR}"},
              "max_num_seqs": {"string_value": "${UNSET_HERE}"},
              "model": {"string_value": "${model}"},  # an unfilled template: the default
              "dtype": {"string_value": "x${ADDR}"}}  # not a whole-value reference: as it is
    assert parameter_values({"parameters": params}, {"ADDR": " h1 "}) == {
        "tensor_parallel_size": "2", "tp_master_addr": "h1", "dtype": "x${ADDR}"}
    assert parameter_values({"parameters": params}, {"TP": "4", "ADDR": ""})[
        "tensor_parallel_size"] == "4"
    with pytest.raises(ValueError, match="parameter tensor_parallel_size: must be an integer"):
        parse_parameters({"parameters": params}, {"TP": "two"})


def test_shipped_config_defaults_without_the_environment():
    """The image's config.pbtxt outside Kubernetes: one process, every rank local, torch's
    thread default, exactly as before the "${...}" parameters."""
    kwargs, _ = parse_parameters({"parameters": _pbtxt_parameters()}, {})
    assert kwargs["tensor_parallel_size"] == 1
    assert not {"tp_local_ranks", "tp_master_addr", "tp_master_port", "num_threads"} & set(kwargs)
