# Two commands do everything on a fresh machine (README.md):
#   make repro   create .venv, install, fetch the pinned assets, `dvc repro` the default experiment
#   make test    create .venv, install, fetch the pinned assets, run the tests (fast + slow)
# Variables: EXPERIMENT=default|cpu_full|smoke, OVERRIDES='generate.max_new_tokens=64 ...',
#            STAGES='evaluate@eagle evaluate@eagle_lookup' (only these and what they need; default: all),
#            TORCH='torch==2.13.0' (the CPU wheel here; on a GPU machine e.g. TORCH=torch).

PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(abspath $(VENV))/bin
TORCH ?= torch==2.13.0
EXPERIMENT ?= default
OVERRIDES ?=
STAGES ?=
export PATH := $(BIN):$(PATH)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup params assets repro test test-fast lint bench clean-venv

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

params: setup
	$(BIN)/python pipelines/compose.py experiment=$(EXPERIMENT) $(OVERRIDES)

assets: setup
	$(BIN)/python pipelines/fetch_assets.py

repro: params
	$(BIN)/dvc repro $(STAGES)

test: setup assets
	$(BIN)/python -m pytest

test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

lint: setup
	$(BIN)/ruff check src pipelines tests benchmarks

bench: setup assets
	$(BIN)/python benchmarks/generate_throughput.py

clean-venv:
	rm -rf $(VENV)
