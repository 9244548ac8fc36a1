#!/usr/bin/env bash
# Makes a venv that runs the real SGLang 0.5.23 server on an x86 CPU (no GPU), with this
# repository's adapter installed, for `make sglang-test` and the SGLang benchmarks.
#
# usage: install.sh VENV_DIR REPO_DIR
#
# What it does (README.md next to this file says why each step is needed):
#   1. checks the CPU (x86-64 with AVX2; with AMX the kernel is built with AMX code paths);
#   2. makes or reuses VENV_DIR: torch 2.13.0 (CPU build), the pinned runtime deps, sglang
#      --no-deps;
#   3. builds the CPU kernel (sglang-kernel-cpu 0.4.6.post1) from sgl-kernel-cpu-src.tar.gz, once
#      per machine kind: the wheel is cached under ${XDG_CACHE_HOME:-~/.cache}/evald/sglang-kernel,
#      keyed by the source, the build flags and the torch version;
#   4. applies the three patches (patch_sglang.py), installs the adapter from REPO_DIR (editable),
#      and checks that SGLang's scheduler imports.
#
# Idempotent: a rerun on the same venv reuses what is there. The chosen instruction set is kept in
# VENV_DIR/.evald-kernel-isa (with the build key); a venv moved to a CPU of the other kind gets the
# other kernel.
# Exit status: 0 ok, 1 a step failed, 2 bad usage or no Python 3.11, 3 this CPU cannot run the
# kernel (the message says why), 4 a system piece is missing (the message says which).
# Environment: PYTHON (default python3.11, else python3), TORCH_SPEC (default torch==2.13.0),
# and pip's own PIP_* variables.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
KERNEL_SRC="$HERE/sgl-kernel-cpu-src.tar.gz"
KERNEL_VERSION="0.4.6.post1"
REQS="$HERE/requirements-runtime.txt"
SGLANG_SPEC="sglang==0.5.23"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

step() { echo "==> [$(date +%T)] $*"; }
fail() {
  local code=$1; shift
  echo "sglang-cpu install: ERROR: $*" >&2
  # A CPU that cannot run the kernel is not an error of the install: say so where the tests look.
  if [ "$code" = 3 ]; then mkdir -p "$VENV" && echo "$*" > "$VENV/.unsupported"; fi
  exit "$code"
}

[ $# -eq 2 ] || { echo "usage: $0 VENV_DIR REPO_DIR" >&2; exit 2; }
VENV="$1"
rm -f "$VENV/.unsupported"
REPO="$(cd "$2" && pwd)"
T0=$(date +%s)

# --- 1. the CPU -------------------------------------------------------------------------------
step "checking the CPU"
[ "$(uname -m)" = x86_64 ] || fail 3 "SGLang's CPU kernel is x86-64 code; this machine is $(uname -m)"
grep -qw avx2 /proc/cpuinfo || fail 3 "this CPU lacks AVX2 ('avx2' in /proc/cpuinfo); the kernel needs x86-64-v3 at least"
if grep -qw amx_tile /proc/cpuinfo && grep -qw avx512f /proc/cpuinfo; then
  ISA="x86-64-v4-amx"   # SGLang uses its intel_amx attention backend and the kernel's ops
  CMAKE_ISA=""
  echo "    AVX-512 and AMX: the kernel is built with its AMX paths (bf16 only, see README.md)"
else
  ISA="x86-64-v3"       # SGLang falls back to torch_native attention and PyTorch ops
  CMAKE_ISA="-DSGL_KERNEL_CPU_X86_V3=ON"
  echo "    no AMX: an x86-64-v3 kernel; SGLang will log 'does not support Intel AMX, will fallback to torch_native backend'"
fi
# awk reads all of ldconfig's output: exiting at the first match could end ldconfig with SIGPIPE,
# which pipefail turns into a failed install (exit 141), depending on timing.
NUMA_SO="$(ldconfig -p 2>/dev/null | awk '/libnuma\.so\.1 .*x86-64/ && !found {print $NF; found = 1}')"
[ -n "$NUMA_SO" ] && [ -e "$NUMA_SO" ] || fail 4 "libnuma.so.1 not found (apt-get install libnuma1)"
command -v g++ >/dev/null || fail 4 "g++ not found (apt-get install g++; GCC >= 11)"

PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3 || true)}"
[ -n "$PYTHON" ] || fail 2 "no python3.11 or python3 on PATH (set PYTHON=...)"

# --- 2. venv, torch, runtime deps, sglang -------------------------------------------------------
if [ -x "$VENV/bin/python" ]; then
  step "reusing venv $VENV"
else
  step "creating venv $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
VENV="$(cd "$VENV" && pwd)"
VPY="$VENV/bin/python"
[ "$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = 3.11 ] ||
  fail 2 "the venv's Python is not 3.11 (the kernel is built for cp311)"
PIP=("$VPY" -m pip --disable-pip-version-check --quiet)
CONSTRAINTS="$VENV/evald-constraints.txt"
{ grep -v '^#' "$REQS"; echo "$TORCH_SPEC"; } > "$CONSTRAINTS"

step "installing $TORCH_SPEC (the CPU build), $(grep -vc '^#' "$REQS") pinned runtime deps, $SGLANG_SPEC --no-deps"
"${PIP[@]}" install -c "$CONSTRAINTS" "$TORCH_SPEC"
"$VPY" -c 'import sys, torch; sys.exit(0 if torch.__version__.startswith("2.13.0") and torch.version.cuda is None else f"torch {torch.__version__} (cuda {torch.version.cuda}); need 2.13.0, CPU build")' ||
  fail 1 "wrong torch in the venv; point pip at a CPU build of torch 2.13.0 (PIP_FIND_LINKS / PIP_EXTRA_INDEX_URL)"
"${PIP[@]}" install -c "$CONSTRAINTS" -r "$REQS"
"${PIP[@]}" install --no-deps "$SGLANG_SPEC"

# --- 3. the kernel, built from source ---------------------------------------------------------------
TORCH_VERSION="$("$VPY" -c 'import torch; print(torch.__version__)')"
KEY="$( { sha256sum "$KERNEL_SRC" "$HERE/patch_sglang.py" | cut -d' ' -f1; echo "$ISA $TORCH_VERSION $(g++ -dumpfullversion)"; } | sha256sum | cut -c1-16)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/evald/sglang-kernel/$KEY"
WHEEL="$CACHE/sglang_kernel_cpu-$KERNEL_VERSION-cp311-cp311-linux_x86_64.whl"
build_kernel() {
  step "kernel: building sglang-kernel-cpu $KERNEL_VERSION ($ISA) from $(basename "$KERNEL_SRC") (several CPU-minutes, once)"
  BUILD="$(mktemp -d "${TMPDIR:-/tmp}/evald-sgl-kernel.XXXXXX")"
  trap 'rm -rf "$BUILD"' EXIT
  mkdir -p "$BUILD/src" "$CACHE"
  tar -xzf "$KERNEL_SRC" -C "$BUILD/src" --strip-components=1
  "$VPY" "$HERE/patch_sglang.py" kernel-cmake "$BUILD/src"
  NUMA_INC=/usr/include
  if [ ! -f /usr/include/numa.h ]; then  # the header only: unpack libnuma-dev, install nothing
    mkdir -p "$BUILD/numa"
    ( cd "$BUILD/numa" && apt-get download libnuma-dev >/dev/null 2>&1 ) ||
      fail 4 "numa.h is missing and 'apt-get download libnuma-dev' failed (apt-get install libnuma-dev)"
    dpkg -x "$BUILD"/numa/libnuma-dev_*.deb "$BUILD/numa/root"
    NUMA_INC="$BUILD/numa/root/usr/include"
  fi
  "${PIP[@]}" install "scikit-build-core==1.1.2" "pathspec==1.1.1"
  # (awk reads to the end, as above: no SIGPIPE for cmake)
  if ! cmake --version 2>/dev/null | awk 'NR==1 {split($3, v, "."); ok = v[1] > 3 || (v[1] == 3 && v[2] >= 18)} END {exit !ok}'; then
    "${PIP[@]}" install "cmake>=3.18,<4"
  fi
  ( cd "$BUILD/src" &&
    VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" CPATH="$NUMA_INC${CPATH:+:$CPATH}" \
    CXXFLAGS="-ffile-prefix-map=$BUILD/src=sgl-kernel-cpu-src -ffile-prefix-map=$VENV=venv${CXXFLAGS:+ $CXXFLAGS}" \
    CMAKE_ARGS="-DNUMA_LIB=$NUMA_SO $CMAKE_ISA" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    nice -n 5 "$VPY" -m pip --disable-pip-version-check wheel . --no-build-isolation --no-deps \
      -w "$BUILD/wheels" -C build-dir="$BUILD/cmake-build" ) > "$BUILD/build.log" 2>&1 ||
    { tail -30 "$BUILD/build.log" >&2; fail 1 "kernel build failed (log above)"; }
  mv "$BUILD/wheels/$(basename "$WHEEL")" "$WHEEL.partial" && mv "$WHEEL.partial" "$WHEEL"
}

INSTALLED_ISA="$(cat "$VENV/.evald-kernel-isa" 2>/dev/null || true)"
if [ "$INSTALLED_ISA" = "$KEY" ] && "$VPY" -m pip show -q sglang-kernel-cpu 2>/dev/null; then
  step "kernel: the $ISA build is installed"
else
  if [ -f "$WHEEL" ]; then
    step "kernel: reusing $WHEEL ($ISA, built earlier on this machine)"
  else
    build_kernel
  fi
  step "kernel: installing the $ISA build"
  "${PIP[@]}" install --no-deps --force-reinstall "$WHEEL"
  echo "$KEY" > "$VENV/.evald-kernel-isa"
fi

# --- 4. patches, the adapter, the check ---------------------------------------------------------
step "patches: kernel-shim, amx-backend, torchvision-init"
for patch in kernel-shim amx-backend torchvision-init; do "$VPY" "$HERE/patch_sglang.py" "$patch"; done
step "installing the adapter from $REPO (editable; its core dependencies within the pins)"
"${PIP[@]}" install -c "$CONSTRAINTS" -e "$REPO"
step "checking: import torchvision, the kernel shim, SGLang's scheduler, the adapter's hooks"
SGLANG_USE_CPU_ENGINE=1 "$VPY" -W ignore -c '
import torchvision
from sgl_kernel import _evald_compat
assert _evald_compat._SCHEMA == (19, 17), _evald_compat._SCHEMA
import sglang.srt.managers.scheduler
from engine_adapter.sglang import plugin
missing = plugin.check_internals()
assert plugin.scheduler_available() and not missing, missing
' || fail 1 "import check failed"
step "done in $(( $(date +%s) - T0 )) s: $VENV ($ISA kernel)"
