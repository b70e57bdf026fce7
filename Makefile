# medvol: `make train` and `make test` set everything up on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.medvol-installed
ARGS ?=

.PHONY: help setup train test test-slow test-newest lint clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /  make \1\t/' | expand -t 22

setup: $(STAMP)  ## create .venv and install medvol with its dependencies

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU machine gets the local CPU wheel; a machine that already has torch (e.g. CUDA) keeps it.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,slurm,sweep,export]"
	touch $(STAMP)

train: setup  ## train with the defaults; pass overrides as ARGS="model=vqgan trainer.max_epochs=5"
	$(PY) train.py $(ARGS)

# One BLAS/OpenMP thread per process unless the caller sets it: the tests' volumes are tiny, and their two-rank
# runs oversubscribe a 2-core machine (two full runs side by side there: 918 s with one thread, 1492 s with PyTorch's
# default).
TEST_THREADS := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}
# Two pytest workers (pytest-xdist), a test file to each in turn, so the second core works while the first runs a
# long single-process test; the documented commands of one guide share a file and stay in order. `make test
# TEST_WORKERS=0` runs everything in one process.
TEST_WORKERS ?= 2
PYTEST := -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: setup  ## the fast tests (ARGS are passed to pytest)
	$(TEST_THREADS) $(PY) $(PYTEST) $(ARGS)

test-slow: setup  ## the slow tests (sweeps, DDP, SLURM, command-line runs)
	$(TEST_THREADS) $(PY) $(PYTEST) -m slow $(ARGS)

# A fresh install as a user gets it today: a scratch venv with the newest release of every dependency that
# pyproject.toml allows (pip's eager upgrade), torch pinned to the local CPU wheel, then the fast tests. What a new
# release breaks shows here before a user meets it; the versions it ran with are printed first.
NEWEST ?= $(VENV)-newest
# Another Python: `make test-newest PYTHON=python3.10 TORCH=torch==2.14.1 NEWEST=.venv-310` (PyPI's build of torch).
TORCH ?= torch==2.13.0

test-newest:  ## the fast tests in a scratch venv (.venv-newest) with the newest versions pyproject.toml allows
	rm -rf $(NEWEST)
	$(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	$(NEWEST)/bin/python -m pip install -q $(TORCH)
	$(NEWEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[dev,slurm,sweep,export]" $(TORCH)
	$(NEWEST)/bin/python -m pip freeze --exclude-editable | tee $(NEWEST)/versions.txt
	$(TEST_THREADS) $(NEWEST)/bin/python $(PYTEST) $(ARGS)

lint: setup  ## ruff
	$(VENV)/bin/ruff check .

clean:  ## remove outputs/ (every run!), multirun/ and pytest caches
	rm -rf outputs multirun .pytest_cache
