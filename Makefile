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
# The supported-JAX window's ends (sparsegen/jaxwindow.py; tests/test_jax_window.py keeps them
# equal): `make test-window` runs the suite's fast subset under each, in a venv of its own.
# TPU modules need jax >= 0.11.0, GPU modules >= 0.11.2. $(VENV) takes the newest jax[tpu] the
# window resolves to; CI's `make test` runs the whole suite there.
JAX_OLDEST := 0.11.0
JAX_GPU_OLDEST := 0.11.2
JAX_NEWEST := 0.12.1
WINDOW_PACKAGES_$(JAX_OLDEST) := 'jax[tpu]==$(JAX_OLDEST)'
WINDOW_PACKAGES_$(JAX_GPU_OLDEST) := jax==$(JAX_GPU_OLDEST) jaxlib==$(JAX_GPU_OLDEST)
# jax[tpu] 0.12.1 asks for libtpu 0.0.53, which is not out: this end names the newest libtpu.
WINDOW_PACKAGES_$(JAX_NEWEST) := jax==$(JAX_NEWEST) jaxlib==$(JAX_NEWEST) libtpu==0.0.52
# What a jax release changes under generated modules: the CPU interpreter and the TPU
# simulator (einsums, attention, paged decode), gradients under jit, conditions, AOT compiles
# through libtpu on one chip and on a multi-chip mesh; for GPU modules the Mosaic GPU
# interpreter and lowering under an abstract H200.
TPU_WINDOW_TESTS := tests/test_kernels.py tests/test_calls.py tests/test_sum_conditions.py tests/test_aot.py \
	tests/test_sharded_aot.py tests/test_attention.py::test_example_matches_numpy \
	tests/test_attention.py::test_example_gradients tests/test_paged.py::test_paged_decode_against_the_oracle \
	tests/test_gradients.py::test_vjp_under_jit_gives_every_argument_a_cotangent
GPU_WINDOW_TESTS := tests/test_gpu_conditions.py
WINDOW_TESTS_$(JAX_OLDEST) := tests/test_jax_window.py $(TPU_WINDOW_TESTS)
WINDOW_TESTS_$(JAX_GPU_OLDEST) := tests/test_jax_window.py $(GPU_WINDOW_TESTS)
WINDOW_TESTS_$(JAX_NEWEST) := tests/test_jax_window.py $(TPU_WINDOW_TESTS) $(GPU_WINDOW_TESTS)
WINDOW_ENDS := $(JAX_OLDEST) $(JAX_GPU_OLDEST) $(JAX_NEWEST)

.PHONY: run run-all test test-window build check clean venv gpu-venv

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

# Every spec compiled for every TPU target and ptxas on every GPU kernel (`make run` takes the
# targets in turn and one example of each GPU walk).
run-all: build
	$(BIN)/python scripts/run_examples.py --all

# worksteal: each worker takes half the suite in order, and takes from the other's queue when
# its own runs out; a file's tests mostly stay on one worker, so the per-process build cache
# (tests/conftest.py) and module fixtures are shared rather than built on both. The 30
# slowest tests are listed at the end: where the time goes, for the next cut.
test: venv gpu-venv
	$(BIN)/python -m pytest -n 2 --dist worksteal --durations=30 $(PYTEST_ARGS)

.venv-jax-%/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: Python >= 3.12 not found" >&2; exit 2; }
	$(PYTHON) -m venv .venv-jax-$*
	.venv-jax-$*/bin/pip install --quiet --upgrade pip
	.venv-jax-$*/bin/pip install --quiet -e '.[tools]' $(WINDOW_PACKAGES_$*)
	touch $@

# Every end runs, each with its time; it fails if any does.
test-window: $(foreach v,$(WINDOW_ENDS),.venv-jax-$(v)/.installed)
	@status=0; $(foreach v,$(WINDOW_ENDS),\
	  echo "== jax $(v): $(WINDOW_TESTS_$(v))"; start=$$(date +%s); \
	  .venv-jax-$(v)/bin/python -m pytest -n 2 --dist worksteal -q -p no:cacheprovider $(WINDOW_TESTS_$(v)) $(PYTEST_ARGS) \
	    || status=1; echo "== jax $(v): $$(( $$(date +%s) - start )) s"; ) exit $$status

clean:
	rm -rf $(VENV) $(GPU_VENV) $(foreach v,$(WINDOW_ENDS),.venv-jax-$(v)) .pytest_cache .hypothesis
