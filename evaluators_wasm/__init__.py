"""The guests: the standard evaluators' Zig sources, their built ``.wasm`` modules, their
Python references (``evaluators_wasm.reference``) and conformance cases.

A package of data and references, at the bottom of the tree: it imports nothing of evald, and
evald never imports it (the daemon reads the built modules as files, docs/design.md §8). The
standard set's names are ``evald.contract.STANDARD_EVALUATORS``; ``make wasm`` rebuilds every
``src/NAME/`` into ``wasm/NAME.wasm`` with ``evald build``, byte-identically.

``ports/`` holds the same evaluators written in the SDK's other languages (``checksum_rust``,
``checksum_as``: checksum/1 in Rust and AssemblyScript), each an ordinary tenant folder with its
built module beside its source. They are not part of the standard set and are not served by
default: the tests hold them to the standard module byte for byte, and ``evald bench host``
compares what each language costs. They stay out of the wheel.

``examples/`` holds example tenant evaluators written with the SDK's guest libraries
(``booking_policy``: the booking study's policy in Zig with ``evald_json``, and its Python
reference ``reference/booking_policy.py``), each an ordinary tenant folder with its built module
beside its source (``make examples``); not served by default, not in the wheel.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "EXAMPLES",
    "EXAMPLES_DIR",
    "PORTS",
    "PORTS_DIR",
    "SOURCE_DIR",
    "WASM_DIR",
    "example_path",
    "port_path",
    "wasm_path",
]

SOURCE_DIR = Path(__file__).resolve().parent / "src"
WASM_DIR = Path(__file__).resolve().parent / "wasm"
PORTS_DIR = Path(__file__).resolve().parent / "ports"
EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"
#: Each example tenant evaluator: its language.
EXAMPLES = {"booking_policy": "zig"}
#: Each port: (the standard evaluator it ports, its language).
PORTS = {"checksum_rust": ("checksum", "rust"), "checksum_as": ("checksum", "assemblyscript")}


def wasm_path(name: str) -> Path:
    """Path of the committed, built module for a standard evaluator."""
    return WASM_DIR / f"{name}.wasm"


def port_path(name: str) -> Path:
    """Path of a port's committed, built module (``ports/NAME/NAME.wasm``, where ``evald build``
    writes it)."""
    return PORTS_DIR / name / f"{name}.wasm"


def example_path(name: str) -> Path:
    """Path of an example's committed, built module (``examples/NAME/NAME.wasm``)."""
    return EXAMPLES_DIR / name / f"{name}.wasm"
