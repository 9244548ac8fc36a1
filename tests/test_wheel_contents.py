"""What the product wheel ships, decided file kind by file kind (docs/design.md §8, "The wheel").

The wheel is built for real (setuptools, as ``pip install .`` builds it) from a copy of the
files it is made of, and its file list is checked: the runtime, the guests' built modules,
sources and references, the public test harnesses; none of the repository's tools, tests,
conformance cases, ports (``evaluators_wasm/ports/``) or the lab; the SDK's templates and guest
libraries are in it, so ``evald new`` and ``evald build`` work from the wheel alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from evald.contract import STANDARD_EVALUATORS

ROOT = Path(__file__).resolve().parent.parent
#: What the wheel is built from (pyproject.toml's packages and their data).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "evald", "engine_adapter", "evaluators_wasm")


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(
                path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so")
            )
        else:
            shutil.copy2(path, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(out), str(source)],
        check=True, capture_output=True, timeout=600,
        # The pure wheel: the same Python files, without compiling the native epoch ticker.
        env={**os.environ, "EVALD_PURE": "1"},
    )  # fmt: skip
    (wheel,) = out.glob("evald-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_the_wheel_ships_the_runtime_and_the_guests(wheel_files: set[str]) -> None:
    for name in STANDARD_EVALUATORS:
        assert f"evaluators_wasm/wasm/{name}.wasm" in wheel_files
        assert f"evaluators_wasm/src/{name}/manifest.json" in wheel_files  # standard_evaluators()
        assert f"evaluators_wasm/reference/{name}.py" in wheel_files  # --evaluator-mode python
    for path in (
        "evald/daemon/default_config.toml",
        "evald/contract/_abi.py",
        "evald/sdk/_toolchain.py",
        # `evald new --lang rust|assemblyscript` and their builds, from an installed wheel
        "evald/sdk/_templates/main.zig",
        "evald/sdk/_templates/rust/Cargo.toml",
        "evald/sdk/_templates/rust/src/lib.rs",
        "evald/sdk/_templates/assemblyscript/package.json",
        "evald/sdk/_templates/assemblyscript/assembly/index.ts",
        "evald/sdk/_templates/assemblyscript/assembly/tsconfig.json",
        "evald/sdk/guest/rust/evald-guest/Cargo.toml",
        "evald/sdk/guest/rust/evald-guest/src/lib.rs",
        "evald/sdk/guest/assemblyscript/evald-guest/package.json",
        "evald/sdk/guest/assemblyscript/evald-guest/index.ts",
        "evald/sdk/guest/assemblyscript/evald-guest/abi.ts",
        "evald/testing/__init__.py",
        "engine_adapter/testing/sglang.py",
        "engine_adapter/evaluation/_inprocess.py",
    ):
        assert path in wheel_files, path


def test_the_wheel_ships_no_repository_tool_test_case_or_lab(wheel_files: set[str]) -> None:
    tops = {name.split("/")[0] for name in wheel_files}
    assert tops <= {"evald", "engine_adapter", "evaluators_wasm"} | {
        name for name in tops if name.endswith(".dist-info")
    }, tops
    leaked = sorted(
        name
        for name in wheel_files
        if "/conformance/" in name  # the tests' cases
        or "/ports/" in name  # the standard evaluators in other languages: tests and benchmarks
        or name.endswith(("_protogen.py", "evaluators_wasm/build.py", "/toolchain.py"))
        or "evald_lab" in name
        or name.startswith(("tools/", "tests/", "lab/"))
    )
    assert not leaked, leaked
