"""The SGLang adapter: an SGLang plugin that evaluates spans through evald during decoding.

Install ``evald[sglang]`` next to SGLang 0.5.23, set ``EVALD_TARGET`` (and ``EVALD_TOKEN``), and
launch SGLang with ``--grammar-backend xgrammar``: SGLang loads :func:`plugin.register` from the
``sglang.srt.plugins`` entry point in each of its processes. Requests ask for evaluation with a
structural tag from :func:`structural_tag_for`. See ``docs/sglang.md``.

Importing this package does not import SGLang or torch (the request helper runs on clients);
:class:`EvaluatorGrammar` is loaded on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine_adapter.serving import DEFAULT_DEADLINE_MS, AdapterConfig, ConfigError
from engine_adapter.sglang.request import (
    OperandsOff,
    generate_sampling_params,
    instruction_messages,
    structural_tag_for,
    tenant_params,
)

if TYPE_CHECKING:
    from engine_adapter.sglang._grammar_object import EvaluatorGrammar

__all__ = [
    "DEFAULT_DEADLINE_MS",
    "AdapterConfig",
    "ConfigError",
    "EvaluatorGrammar",
    "OperandsOff",
    "generate_sampling_params",
    "instruction_messages",
    "structural_tag_for",
    "tenant_params",
]


def __getattr__(name: str) -> Any:
    if name == "EvaluatorGrammar":
        from engine_adapter.sglang._grammar_object import EvaluatorGrammar

        return EvaluatorGrammar
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
