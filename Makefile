# Two commands on a fresh machine: `make run` and `make test`.
# JAX 0.12 needs Python >= 3.12; we look for it on PATH, then under pyenv.
PYTHON ?= $(shell for c in python3.13 python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3 $$HOME/.pyenv/versions/3.13*/bin/python3; do \
	  $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 && { command -v $$c || echo $$c; } && break; done)
VENV := .venv
BIN := $(VENV)/bin
# The jax-cuda13 plugin and ptxas, for compiling GPU kernels for a compile-only H200 (stage 3
# of `sparsegen verify --target h200`); a venv of its own, so the TPU venv never loads CUDA.
GPU_VENV := .venv-gpu
GPU_PACKAGES := jax==0.12.0.1 jaxlib==0.12.0.1 jax-cuda13-plugin==0.12.0.1 jax-cuda13-pjrt==0.12.0.1 'nvidia-cuda-nvcc>=13,<14'
SPECS := $(wildcard specs/*.spk)
# The mixture-of-experts example's kernels, built into the example (examples/moe_transformer/).
EXAMPLE_SPECS := $(wildcard examples/moe_transformer/specs/*.spk)
# libtpu looks for TPU hosts at start-up; these keep it quiet where there is none.
export TPU_SKIP_MDS_QUERY := 1
# Parallel test workers each load libtpu (for AOT compiles only); let them share it.
export ALLOW_MULTIPLE_LIBTPU_LOAD := 1

.PHONY: run test build check clean venv gpu-venv

$(BIN)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: Python >= 3.12 not found (JAX 0.12 needs it); install it or set PYTHON=..." >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

venv: $(BIN)/.installed

# A failed install is not fatal: the stage-3 tests then skip and say why.
$(GPU_VENV)/.installed:
	@test -n "$(PYTHON)" || { echo "error: Python >= 3.12 not found" >&2; exit 2; }
	-$(PYTHON) -m venv $(GPU_VENV) && $(GPU_VENV)/bin/pip install --quiet $(GPU_PACKAGES) && touch $@

gpu-venv: $(GPU_VENV)/.installed

build: venv
	$(BIN)/sparsegen build $(SPECS) -o generated
	$(BIN)/sparsegen build $(EXAMPLE_SPECS) -o examples/moe_transformer/kernels

check: venv
	$(BIN)/sparsegen check $(SPECS) -o generated
	$(BIN)/sparsegen check $(EXAMPLE_SPECS) -o examples/moe_transformer/kernels

run: build
	$(BIN)/python scripts/run_examples.py

# worksteal: each worker takes half the suite in order, and takes from the other's queue when
# its own runs out; a file's tests mostly stay on one worker, so the per-process build cache
# (tests/conftest.py) and module fixtures are shared rather than built on both. The 30
# slowest tests are listed at the end: where the time goes, for the next cut.
test: venv gpu-venv
	$(BIN)/python -m pytest -n 2 --dist worksteal --durations=30 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(GPU_VENV) .pytest_cache .hypothesis
