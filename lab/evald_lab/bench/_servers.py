"""What the SGLang and vLLM stall benchmarks share: an evaluator that spins to its deadline."""

from __future__ import annotations

from typing import Any

__all__ = ["register_spinner"]


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
