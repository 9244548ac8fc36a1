"""The README's layout table matches the tree: every path its first column names exists, and the
table names every subpackage of the product packages (a new package must be placed in it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("evald", "engine_adapter", "evaluators_wasm")


def _layout_table() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def _first_column_paths(table: str) -> list[str]:
    paths = []
    for row in table.splitlines()[2:]:
        first = row.split("|")[1]
        paths += re.findall(r"`([^`]+)`", first)
    return paths


def test_every_path_the_table_names_exists() -> None:
    paths = _first_column_paths(_layout_table())
    assert paths, "the README's layout table has no rows"
    missing = [path for path in paths if not (ROOT / path).exists() and "/" in path]
    assert not missing, f"the README's layout table names paths that do not exist: {missing}"


def test_every_product_subpackage_has_a_row() -> None:
    named = set(re.findall(r"`([^`]+)`", _layout_table()))
    subpackages = sorted(
        f"{init.parent.relative_to(ROOT)}/"
        for top in PRODUCT
        for init in (ROOT / top).glob("*/__init__.py")
    )
    assert subpackages, "no subpackages found: the product moved?"
    unplaced = [package for package in subpackages if package not in named]
    assert not unplaced, (
        f"subpackages without a row in the README's layout table: {unplaced} (say what they are)"
    )
