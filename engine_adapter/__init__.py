"""Engine adapter: span grammar, injector, evaluator clients and engines.

The engine-independent part (this package's core) turns evaluator manifests into an XGrammar
structural tag (:func:`build_structural_tag`, :func:`lower_evaluated_tags`), follows each request's
tokens to detect closed spans and force their results (:class:`Injector`), and evaluates spans
through the evald daemon (:class:`EvaluatorClient`) or in process (:class:`InProcessWasmEvaluator`,
:class:`ReferenceEvaluator`).
"""

from engine_adapter._client import ClientStats, EvaluatorClient, list_evaluators
from engine_adapter._evaluated_tag import (
    EvaluatedTagError,
    contains_evaluated_tag,
    lower_evaluated_tags,
)
from engine_adapter._grammar import (
    ERROR_CODE_REGEX,
    EvaluatorSpec,
    Mode,
    SpanGrammar,
    build_structural_tag,
    special_token_texts,
    standard_evaluators,
)
from engine_adapter._injector import Injector, SpanRecord, TokenCodec
from engine_adapter._inprocess import InProcessWasmEvaluator, ReferenceEvaluator
from engine_adapter._types import EvalResult, SpanBinding, SpanEvaluator

__all__ = [
    "ERROR_CODE_REGEX",
    "ClientStats",
    "EvalResult",
    "EvaluatedTagError",
    "EvaluatorClient",
    "EvaluatorSpec",
    "InProcessWasmEvaluator",
    "Injector",
    "Mode",
    "ReferenceEvaluator",
    "SpanBinding",
    "SpanEvaluator",
    "SpanGrammar",
    "SpanRecord",
    "TokenCodec",
    "build_structural_tag",
    "contains_evaluated_tag",
    "list_evaluators",
    "lower_evaluated_tags",
    "special_token_texts",
    "standard_evaluators",
]
