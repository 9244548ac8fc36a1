"""What the SGLang and vLLM stall benchmarks share: an evaluator that spins to its deadline, and
spans whose result and error openers share nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["apart", "register_spinner"]


def apart(binding: Any) -> Any:
    """``binding`` with result and error openers that share no first character (``[`` and
    ``{``): nothing of its result region can be forced before the value is known."""
    return dataclasses.replace(
        binding, result_begin="[", result_end="]", error_begin="{", error_end="}"
    )


def register_spinner(target: str, token: str) -> Any:
    """Registers, for the tenant of ``token``, an evaluator ``spin`` that loops until its
    deadline; returns its spec as that tenant lists it."""
    from engine_adapter import list_evaluators
    from evald.client import Client
    from evald.testing import guest, manifest_bytes

    module = guest(
        "loop", manifest=manifest_bytes(name="spin", tag="spin", semantics_version="spin/1")
    )
    with Client(target, token) as client:
        client.register(module, replace=True)
    return {spec.name: spec for spec in list_evaluators(target, token)}["spin"]
