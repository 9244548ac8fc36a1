"""Evaluating spans: the per-request span state and the evaluators it submits to.

The :class:`Injector` follows one request's tokens, detects each closed span, submits it and
says which tokens to force; the :class:`TokenCodec` is the tokenizer's bytes, shared by an
engine's requests. The evaluators: the evald daemon through the streaming
:class:`EvaluatorClient` (and :func:`list_evaluators` for its manifests), or in process
(:class:`InProcessWasmEvaluator`, :class:`ReferenceEvaluator`). Engine-independent: no engine,
no server; below it only :mod:`engine_adapter.spans` and evald's client and contract.
"""

from engine_adapter.evaluation._client import (
    ClientStats,
    EvaluatorClient,
    evaluator_listing,
    list_evaluators,
)
from engine_adapter.evaluation._injector import Injector, SpanRecord, TokenCodec
from engine_adapter.evaluation._inprocess import InProcessWasmEvaluator, ReferenceEvaluator

__all__ = [
    "ClientStats",
    "EvaluatorClient",
    "InProcessWasmEvaluator",
    "Injector",
    "ReferenceEvaluator",
    "SpanRecord",
    "TokenCodec",
    "evaluator_listing",
    "list_evaluators",
]
