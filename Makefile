# medvol: `make train` and `make test` set everything up on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.medvol-installed
ARGS ?=

.PHONY: setup train test test-slow lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU machine gets the local CPU wheel; a machine that already has torch (e.g. CUDA) keeps it.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,slurm,sweep]"
	touch $(STAMP)

train: setup
	$(PY) train.py $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

test-slow: setup
	$(PY) -m pytest -q -m slow $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf outputs multirun .pytest_cache
