"""Python reference implementations of the standard evaluators.

Each module ``evaluators_wasm.reference.NAME`` exposes ``evaluate(data: bytes) -> str``, which
returns the canonical value or raises :class:`GuestError` with the same code the WASM evaluator
returns. They define the semantics in executable form (the differential tests compare the WASM
modules against them) and are the in-process baseline of the overhead benchmark.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["GuestError", "reference"]


class GuestError(Exception):
    """An evaluator error: ``code`` is one of the guest codes of docs/abi.md."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message


def reference(name: str) -> Callable[[bytes], str]:
    """The reference ``evaluate`` function of a standard evaluator."""
    module = importlib.import_module(f"evaluators_wasm.reference.{name}")
    fn: Callable[[bytes], str] = module.evaluate
    return fn
