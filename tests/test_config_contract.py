"""config.pbtxt declares exactly what the adapter reads and writes: Triton refuses an input the
model does not declare (the OpenAI frontend's `return_logprobs` was refused that way) and drops
nothing the model sends only if it is declared."""
from __future__ import annotations

import re

from backend.triton.request import ALL_INPUTS, RETURN_FIELDS
from client.server import ROOT

CONFIG = (ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()


def _names(section: str) -> set[str]:
    body = re.search(section + r"\s*\[(.*?)\n\]", CONFIG, re.S).group(1)
    return set(re.findall(r'name: "([^"]+)"', body))


def test_declared_inputs_are_the_parsed_inputs():
    assert _names("input") == set(ALL_INPUTS)


def test_declared_outputs_are_text_output_and_the_return_fields():
    assert _names("output") == {"text_output", *RETURN_FIELDS}


def test_the_openai_frontends_vllm_request_is_declared():
    frontend = {"text_input", "stream", "exclude_input_in_output", "sampling_parameters",
                "return_logprobs", "return_num_input_tokens", "return_num_output_tokens"}
    assert frontend <= _names("input")
    assert {"text_output", "num_input_tokens", "num_output_tokens", "logprobs"} <= _names("output")
