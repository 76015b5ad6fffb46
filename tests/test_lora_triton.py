"""LoRA on the Triton side, without a server: config.pbtxt parameters, multi_lora.json,
`lora_name` in sampling_parameters and as a request parameter, the per-adapter request counter."""
from __future__ import annotations

import json

import pytest

from backend.triton.lora_config import lora_modules, read_multi_lora
from backend.triton.lora_metrics import LoraRequests
from backend.triton.model_config import parse_parameters
from backend.triton.request import parse_request
from tests.test_triton_responder import FakePB


def test_parameters_map_to_engine_settings():
    params = {k: {"string_value": v} for k, v in (
        ("enable_lora", "true"), ("max_loras", "2"), ("max_lora_rank", "32"),
        ("max_cpu_loras", "${max_cpu_loras}"))}
    kwargs, _ = parse_parameters({"parameters": params})
    assert kwargs == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 32}
    with pytest.raises(ValueError, match="parameter max_loras: must be an integer"):
        parse_parameters({"parameters": {"max_loras": {"string_value": "two"}}})


def test_multi_lora_json_paths_resolve_against_the_version_folder(tmp_path):
    version = tmp_path / "llm" / "1"
    version.mkdir(parents=True)
    assert read_multi_lora(version) == {}
    (version / "multi_lora.json").write_text(json.dumps(
        {"doll": "./adapters/doll", "sheep": "/abs/sheep"}))
    assert read_multi_lora(version) == {"doll": str(version / "adapters" / "doll"),
                                        "sheep": "/abs/sheep"}
    assert lora_modules({"enable_lora": True}, str(tmp_path / "llm"), "1") == {
        "lora_modules": read_multi_lora(version)}
    assert lora_modules({}, str(tmp_path / "llm"), "1") == {}  # read only with enable_lora
    (version / "multi_lora.json").write_text(json.dumps({"doll": 3}))
    with pytest.raises(ValueError, match="multi_lora.json: adapter 'doll'"):
        read_multi_lora(version)
    (version / "multi_lora.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="multi_lora.json: must be a JSON object"):
        read_multi_lora(version)
    (version / "multi_lora.json").write_text("{")
    with pytest.raises(ValueError, match="multi_lora.json: unreadable"):
        read_multi_lora(version)


def test_lora_name_from_sampling_parameters_or_request_parameters():
    sp = json.dumps({"lora_name": "doll", "temperature": 0})
    assert parse_request({"text_input": "hi", "sampling_parameters": sp}).params.lora_name == "doll"
    assert parse_request({"text_input": "hi"}, {"lora_name": "sheep"}).params.lora_name == "sheep"
    # the request parameter is the more specific source
    assert parse_request({"text_input": "hi", "sampling_parameters": sp},
                         {"lora_name": "sheep"}).params.lora_name == "sheep"
    assert parse_request({"text_input": "hi"}).params.lora_name is None
    with pytest.raises(ValueError, match="sampling_parameters.lora_name"):
        parse_request({"text_input": "hi", "sampling_parameters": json.dumps({"lora_name": ""})})


def test_requests_counted_per_adapter():
    FakePB.MetricFamily.created = []
    counter = LoraRequests(FakePB, {"model": "llm", "version": "1", "instance": "i0"})
    for name in ("doll", None, "doll", "sheep"):
        counter.count(name)
    got = {m.labels["lora_name"]: m.value for m in FakePB.MetricFamily.created}
    assert got == {"doll": 2, "sheep": 1}
    assert all(m.name == "llm_lora_requests_total" and m.labels["model"] == "llm"
               for m in FakePB.MetricFamily.created)
