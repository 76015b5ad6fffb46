"""Embeddings served (vllm_backend's contract, as Triton's OpenAI frontend sends it for
/v1/embeddings: `embedding_request` JSON {"input", "pooling_params": {"dimensions": [d]}} plus
return_num_input_tokens / return_num_output_tokens, no text_input; one final response whose
text_output is the JSON list of floats). The frontend's side, from the server repository's
python/openai engine/utils/triton.py (`_create_vllm_embedding_request`, and the response reader
that json-loads text_output[0] and base64-encodes float32 for encoding_format "base64")."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from tests.integration.grpc_stream import stream_request

pytestmark = pytest.mark.integration
TEXT = "Triton serves embeddings for retrieval."


def frontend_embedding(url: str, value, dimensions: int | None = None) -> list:
    """The frontend's three inputs, sent over a gRPC stream; every response (or the error)."""
    pooling = {"dimensions": [dimensions]} if dimensions is not None else {}
    body = json.dumps({"input": value, "pooling_params": pooling}).encode()
    return stream_request(url, {
        "embedding_request": (np.array([body], dtype=np.object_), "BYTES"),
        "return_num_input_tokens": (np.array([True]), "BOOL"),
        "return_num_output_tokens": (np.array([True]), "BOOL")})


def read_like_the_frontend(results: list) -> tuple[list[float], int, int]:
    """The vector (text_output must be one element), prompt tokens, output tokens."""
    data = [r for r in results if r.as_numpy("text_output") is not None]
    assert len(data) == 1
    out = data[0].as_numpy("text_output")
    assert out.shape == (1,)
    return (json.loads(out[0]), int(data[0].as_numpy("num_input_tokens")[0]),
            int(data[0].as_numpy("num_output_tokens")[0]))


def test_frontend_request_gets_the_offline_vector(server, offline):
    vec, n_in, n_out = read_like_the_frontend(frontend_embedding(server.grpc_url, TEXT))
    want = offline.embed(TEXT)[0]
    assert n_in == want.num_input_tokens and n_out == 0
    assert np.allclose(vec, want.embedding, atol=1e-5, rtol=0)
    assert abs(np.linalg.norm(vec) - 1.0) < 1e-5  # last token, normalized (no modules.json)
    b64 = base64.b64encode(np.array(vec, dtype=np.float32).tobytes()).decode()
    assert np.array_equal(np.frombuffer(base64.b64decode(b64), np.float32),
                          np.array(vec, np.float32))


def test_token_ids_and_dimensions(server, offline):
    ids = offline.tokenizer.encode(TEXT)
    vec, n_in, _ = read_like_the_frontend(frontend_embedding(server.grpc_url, ids, 32))
    want = offline.embed(ids, dimensions=32)[0].embedding
    assert len(vec) == 32 and n_in == len(ids)
    assert np.allclose(vec, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("value,dims,match", [
    (TEXT, 0, "dimensions: must be an integer in"),
    (TEXT, 100000, "dimensions: must be an integer in"),
    ("", None, "embedding_request.input: the text is empty"),
    ([10**9], None, "input: token ids must be in")])
def test_bad_embedding_request_fails_alone(server, value, dims, match):
    from tritonclient.utils import InferenceServerException
    with pytest.raises(InferenceServerException, match=match):
        frontend_embedding(server.grpc_url, value, dims)
    vec, _, _ = read_like_the_frontend(frontend_embedding(server.grpc_url, TEXT))
    assert len(vec) > 0  # the server serves the next one


def test_http_generate_with_an_embedding_request(server):
    import http.client
    conn = http.client.HTTPConnection("localhost", server.http_port, timeout=300)
    body = {"text_input": "", "embedding_request": json.dumps({"input": TEXT}),
            "return_num_input_tokens": True}
    conn.request("POST", "/v2/models/llm/generate", json.dumps(body))
    resp = conn.getresponse()
    data = json.loads(resp.read())
    assert resp.status == 200, data
    vec = json.loads(data["text_output"])
    assert isinstance(vec, list) and len(vec) > 8 and data["num_input_tokens"] > 0
