"""ruff, mypy (strict) and import-linter (the layering contracts), all configured in
pyproject.toml, are part of the test run: findings fail it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CHECKED = ("evald", "engine_adapter", "lab/evald_lab")


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing() -> None:
    result = run(str(BIN / "ruff"), "check", *CHECKED)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_finds_nothing() -> None:
    result = run(sys.executable, "-m", "mypy", *(f"{name}/" for name in CHECKED))
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_contracts_hold() -> None:
    """The layering of docs/design.md ("Layout"): one-way packages, public APIs, no cycles."""
    result = run(str(BIN / "lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr
