"""ruff, mypy (strict) and import-linter (the layering contracts), all configured in
pyproject.toml, are part of the test run: findings fail it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CHECKED = ("evald", "engine_adapter", "lab/evald_lab", "tools")


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing() -> None:
    result = run(str(BIN / "ruff"), "check", *CHECKED)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_finds_nothing() -> None:
    result = run(sys.executable, "-m", "mypy", *(f"{name}/" for name in CHECKED))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("evald_lab") is None,
    reason="the contracts cover the lab too (evald_lab, a root package): pip install -e ./lab",
)
def test_import_contracts_hold() -> None:
    """The layering of docs/design.md ("Layout"): one-way packages, public APIs, no cycles."""
    result = run(str(BIN / "lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_private_module_of_the_adapter_is_protected() -> None:
    """import-linter names modules, not patterns like ``_*`` (``pkg.*`` is a package's
    children): each private module of the adapter — its subpackages' and its engines' — must be
    protected by a contract that lets only its own package import it, including any added
    later."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
    covered: set[str] = set()
    for contract in contracts:
        if contract["type"] != "protected":
            continue
        for name in contract["protected_modules"]:
            package = name[: -len(".*")] if name.endswith(".*") else name.rpartition(".")[0]
            if contract["allowed_importers"] == [package]:
                covered.add(name)
    private = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / "engine_adapter").rglob("_*.py")
        if path.name != "__init__.py"
    }
    assert private, "no private modules found: the adapter moved?"
    unprotected = sorted(
        name
        for name in private
        if name not in covered and f"{name.rpartition('.')[0]}.*" not in covered
    )
    assert not unprotected, f"private modules no protected contract covers: {unprotected}"


def test_cycle_contracts_count_type_checking_imports() -> None:
    """An import under ``TYPE_CHECKING`` still says two modules know each other: the acyclic
    contracts must see it, or a circle can hide behind an annotation."""
    import tomllib

    linter = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert linter.get("exclude_type_checking_imports") is False
