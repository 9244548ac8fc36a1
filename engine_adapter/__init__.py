"""Engine adapter: span grammar, injector, evaluator clients and engines.

The engine-independent part turns evaluator manifests into an XGrammar structural tag
(:func:`build_structural_tag`, :func:`lower_evaluated_tags`), follows each request's tokens to
detect closed spans and force their results (:class:`Injector`), and evaluates spans through the
evald daemon (:class:`EvaluatorClient`) or in process (:class:`InProcessWasmEvaluator`,
:class:`ReferenceEvaluator`). This module only re-exports the names users import; the code lives
in subpackages, each used through its ``__init__``: :mod:`engine_adapter.spans` (the span and
grammar language, no I/O), :mod:`engine_adapter.evaluation` (the injector, the interfaces an
engine provides and calls, the evaluators), :mod:`engine_adapter.serving` (what the server
plugins share, and the one request builder), then the engines (``sglang``, ``vllm``,
``local``), the real-server harness (``testing``) and the CLI (docs/design.md §8).
"""

from engine_adapter.evaluation import (
    ClientStats,
    ComputedFieldsState,
    EvaluatorClient,
    Injector,
    InProcessWasmEvaluator,
    ReferenceEvaluator,
    SpanRecord,
    TokenCodec,
    list_evaluators,
)
from engine_adapter.spans import (
    BASE_PROMPT_FORMAT,
    ERROR_CODE_REGEX,
    INSTRUCTION_STYLES,
    ComputedSchemaError,
    EvalResult,
    EvaluatedTagError,
    EvaluatorExample,
    EvaluatorOperands,
    EvaluatorSpec,
    Mode,
    OperandNarrowing,
    SpanBinding,
    SpanEvaluator,
    SpanGrammar,
    base_prompt,
    build_structural_tag,
    contains_computed,
    contains_evaluated_tag,
    literals_in_text,
    lower_computed_schema,
    lower_evaluated_tags,
    narrow_to_operands,
    render_instructions,
    special_token_texts,
    standard_evaluators,
)

__all__ = [
    "BASE_PROMPT_FORMAT",
    "ERROR_CODE_REGEX",
    "INSTRUCTION_STYLES",
    "ClientStats",
    "ComputedFieldsState",
    "ComputedSchemaError",
    "EvalResult",
    "EvaluatedTagError",
    "EvaluatorClient",
    "EvaluatorExample",
    "EvaluatorOperands",
    "EvaluatorSpec",
    "InProcessWasmEvaluator",
    "Injector",
    "Mode",
    "OperandNarrowing",
    "ReferenceEvaluator",
    "SpanBinding",
    "SpanEvaluator",
    "SpanGrammar",
    "SpanRecord",
    "TokenCodec",
    "base_prompt",
    "build_structural_tag",
    "contains_computed",
    "contains_evaluated_tag",
    "list_evaluators",
    "literals_in_text",
    "lower_computed_schema",
    "lower_evaluated_tags",
    "narrow_to_operands",
    "render_instructions",
    "special_token_texts",
    "standard_evaluators",
]

# The local CPU engine needs torch and a model runtime: its names are imported on first use, so
# that importing the adapter's core (grammar, injector, clients) stays light.
_LOCAL_ENGINE_HOMES = {
    "BACKEND_NAMES": "local",
    "Backend": "local",
    "BackendError": "local",
    "load_backend": "local",
    "EVALUATOR_MODES": "local",
    "EngineError": "local",
    "EvaluatorSetup": "local",
    "GenerationResult": "local",
    "LocalEngine": "local",
    "SpanTiming": "local",
    "StepTiming": "local",
    "open_evaluator": "local",
}
__all__ += list(_LOCAL_ENGINE_HOMES)

import typing as _typing  # noqa: E402

if _typing.TYPE_CHECKING:  # the real types, for type checkers
    from engine_adapter.local import (  # noqa: F401  # noqa: F401
        BACKEND_NAMES,
        EVALUATOR_MODES,
        Backend,
        BackendError,
        EngineError,
        EvaluatorSetup,
        GenerationResult,
        LocalEngine,
        SpanTiming,
        StepTiming,
        load_backend,
        open_evaluator,
    )


def __getattr__(name: str) -> object:
    home = _LOCAL_ENGINE_HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine_adapter' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"engine_adapter.{home}"), name)
    globals()[name] = value
    return value
