"""What the SDK's test files share: ``evald`` run in this process, and the template's semantics.

Imported by name (``tests/conftest.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

from evald.cli import main

__all__ = ["Run", "cli", "roman"]


@dataclass
class Run:
    status: int
    out: str
    err: str


def cli(*args: str | Path) -> Run:
    """Runs ``evald ARGS`` in this process (the console script's own ``main``)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([str(arg) for arg in args])
    return Run(status, out.getvalue(), err.getvalue())


def roman(number: int) -> str:
    """The template's semantics (1994 is MCMXCIV), written independently of every guest."""
    out = ""
    for value, symbol in zip(
        (1000, 900, 500, 400, 100, 90, 50, 40, 10, 9, 5, 4, 1),
        ("M", "CM", "D", "CD", "C", "XC", "L", "XL", "X", "IX", "V", "IV", "I"),
        strict=True,
    ):
        count, number = divmod(number, value)
        out += symbol * count
    return out
