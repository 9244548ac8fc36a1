"""The guests: the standard evaluators' Zig sources, their built ``.wasm`` modules, their
Python references (``evaluators_wasm.reference``) and conformance cases.

A package of data and references, at the bottom of the tree: it imports nothing of evald, and
evald never imports it (the daemon reads the built modules as files, docs/design.md §8). The
standard set's names are ``evald.contract.STANDARD_EVALUATORS``; ``make wasm`` rebuilds every
``src/NAME/`` into ``wasm/NAME.wasm`` with ``evald build``, byte-identically.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SOURCE_DIR", "WASM_DIR", "wasm_path"]

SOURCE_DIR = Path(__file__).resolve().parent / "src"
WASM_DIR = Path(__file__).resolve().parent / "wasm"


def wasm_path(name: str) -> Path:
    """Path of the committed, built module for a standard evaluator."""
    return WASM_DIR / f"{name}.wasm"
