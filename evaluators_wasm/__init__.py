"""The standard evaluators: Zig sources, their built ``.wasm`` modules, and Python references.

``wasm_path(name)`` locates a built module; ``STANDARD_EVALUATORS`` lists the names in the
standard set. The Python reference of each evaluator lives in ``evaluators_wasm.reference``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SOURCE_DIR", "STANDARD_EVALUATORS", "WASM_DIR", "wasm_path"]

SOURCE_DIR = Path(__file__).resolve().parent / "src"
WASM_DIR = Path(__file__).resolve().parent / "wasm"
STANDARD_EVALUATORS = ("calc", "strop", "date", "units", "checksum")


def wasm_path(name: str) -> Path:
    """Path of the committed, built module for a standard evaluator."""
    return WASM_DIR / f"{name}.wasm"
