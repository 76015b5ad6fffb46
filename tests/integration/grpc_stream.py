"""One request over a tritonclient gRPC stream, as vllm_backend's clients send it."""
from __future__ import annotations

import queue

import numpy as np


def stream_request(url: str, tensors: dict[str, tuple[np.ndarray, str]],
                   cancel_after: int | None = None) -> list:
    """Send input name -> (array [1], Triton dtype) on a stream; every response until the
    final one (or, with cancel_after, that many, then the stream is cancelled). A response
    error is raised (tritonclient's InferenceServerException)."""
    import tritonclient.grpc as grpcclient
    inputs = []
    for name, (arr, dtype) in tensors.items():
        inputs.append(grpcclient.InferInput(name, list(arr.shape), dtype))
        inputs[-1].set_data_from_numpy(arr)
    q: queue.SimpleQueue = queue.SimpleQueue()
    results = []
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(lambda result, error: q.put((result, error)))
        client.async_stream_infer("llm", inputs=inputs)
        while True:
            result, error = q.get(timeout=300)
            if error is not None:
                raise error
            results.append(result)
            if cancel_after is not None and len(results) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return results
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    return results
