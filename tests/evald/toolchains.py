"""The compilers the Rust and AssemblyScript tests build with, found as ``evald build`` finds
them: a rustc for wasm32 (CI installs Debian's ``rustc`` and ``libstd-rust-dev-wasm32``) and
the repository's pinned AssemblyScript compiler (``tools/assemblyscript``: ``npm ci`` there,
which ``make toolchains`` and ``.ci/run`` do).

Imported by name (``tests/conftest.py`` puts this folder on ``sys.path``). A test that needs a
missing compiler skips with the SDK's own message saying what to install, except in CI (``CI``
set), where ``.ci/run`` installs both and a missing one fails the test instead of hiding it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

__all__ = ["REPOSITORY_ASC", "require_toolchain", "use_repository_asc"]

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY_ASC = ROOT / "tools" / "assemblyscript" / "node_modules" / ".bin" / "asc"


def use_repository_asc() -> None:
    """Points ``$EVALD_ASC`` at the repository's compiler where it is installed and the
    variable is unset (the suite's CLI calls and daemons inherit it)."""
    if REPOSITORY_ASC.is_file():
        os.environ.setdefault("EVALD_ASC", str(REPOSITORY_ASC))


def require_toolchain(language: str) -> str:
    """The compiler of ``language`` (``rust`` or ``assemblyscript``) as the SDK describes it;
    skips the test (fails it in CI) when there is none."""
    from evald.contract import EvaldError
    from evald.sdk import find_asc, find_rustc

    try:
        if language == "rust":
            return find_rustc().describe()
        return find_asc(ROOT).describe()
    except EvaldError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs every SDK compiler, but: {exc.message}")
        pytest.skip(exc.message)
