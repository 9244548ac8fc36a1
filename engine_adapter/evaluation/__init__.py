"""Evaluating spans: the per-request span state and the evaluators it submits to.

The :class:`Injector` follows one request's tokens, detects each closed span, submits it and
says which tokens to force; the :class:`TokenCodec` is the tokenizer's bytes, shared by an
engine's requests. The evaluators: the evald daemon through the streaming
:class:`EvaluatorClient` (and :func:`list_evaluators` / :func:`tenant_listing` for its
manifests and the caller's tenant), or in process
(:class:`InProcessWasmEvaluator`, :class:`ReferenceEvaluator`). What an engine provides and
calls is written down as two interfaces: :class:`EngineRuntime` (shared by an engine's
requests) and :class:`SpanState` (one request's spans), opened with :func:`open_span_state`.

Engine-independent: no engine, no server; below it only :mod:`engine_adapter.spans` and
evald's client and contract.
"""

from engine_adapter.evaluation._client import ClientStats, EvaluatorClient
from engine_adapter.evaluation._computed_state import ComputedFieldsState
from engine_adapter.evaluation._engine_interface import EngineRuntime, SpanState, open_span_state
from engine_adapter.evaluation._injector import Injector
from engine_adapter.evaluation._inprocess import InProcessWasmEvaluator, ReferenceEvaluator
from engine_adapter.evaluation._listing import (
    EvaluatorListing,
    evaluator_listing,
    list_evaluators,
    tenant_listing,
)
from engine_adapter.evaluation._span_record import SpanRecord
from engine_adapter.evaluation._token_codec import TokenCodec

__all__ = [
    "ClientStats",
    "ComputedFieldsState",
    "EngineRuntime",
    "EvaluatorClient",
    "EvaluatorListing",
    "InProcessWasmEvaluator",
    "Injector",
    "ReferenceEvaluator",
    "SpanRecord",
    "SpanState",
    "TokenCodec",
    "evaluator_listing",
    "list_evaluators",
    "open_span_state",
    "tenant_listing",
]
