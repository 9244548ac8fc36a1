"""A JSON-schema request with computed properties on vLLM: lowered in the API server, followed
in the scheduler.

vLLM validates a request's structured outputs in its API-server process
(``SamplingParams._validate_structured_outputs`` calls
``vllm.v1.structured_output.backend_xgrammar.validate_xgrammar_grammar``), for
``structured_outputs={"json": …}`` and for the OpenAI API's ``response_format`` of type
``json_schema`` alike; its engine core later compiles what validation left. The plugin wraps
that validation (:func:`install_validation`). For a schema that marks a property ``computed`` or
``extracted`` (:func:`engine_adapter.serving.needs_lowering`), the wrapper:

1. lowers it with the request's tenant's evaluators (``ListEvaluators`` with the request's
   ``evald_token`` / ``evald_target``, held per tenant for ``evaluators_ttl_s``) and the
   request's ``evald_operands_from`` text;
2. refuses a bad schema with :class:`ComputedSchemaRefused`, raised to vLLM as its
   ``VLLMClientError`` (HTTP 400; a plain ``ValueError`` becomes a 500, and vLLM's
   ``VLLMValidationError`` would make its ``auto`` backend try another backend, which ignores
   the keyword): the message starts with the JSON pointer;
3. rewrites the request as vLLM does for ``choice``: ``json`` becomes the lowered ``grammar``
   (XGrammar EBNF), and ``extra_args["evald_computed"]`` carries the schema and the manifests of
   the evaluators it uses, from which the scheduler's tracker rebuilds the same plan
   (:func:`computed_plan`) without asking evald on the scheduler's thread.

A request that writes ``evald_computed`` itself only changes what its own tenant evaluates: the
plan must lower to the very grammar the request carries, else the request is not followed.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine_adapter.serving import (
    EXTRA_ARG_OPERANDS,
    AdapterConfig,
    allowed_targets,
    lower_request_schema,
    needs_lowering,
    request_options,
)
from engine_adapter.spans import (
    ComputedPlan,
    ComputedSchemaError,
    EvaluatorSpec,
    EvaluatorsUnavailable,
    lower_computed_schema,
)

__all__ = [
    "COMPUTED_ARG",
    "ComputedSchemaRefused",
    "computed_plan",
    "install_validation",
    "lower_for_request",
]

#: The ``extra_args`` key the API server writes for the scheduler.
COMPUTED_ARG = "evald_computed"
_VALIDATION = "vllm.v1.structured_output.backend_xgrammar"
_MARK = "__evald_hook__"
#: How long the API server waits for one ``ListEvaluators`` answer.
LISTING_TIMEOUT_S = 5.0


class ComputedSchemaRefused(ValueError):
    """A computed JSON schema vLLM must refuse (HTTP 400); the message starts with the pointer.
    The installed validation raises it to vLLM as a ``VLLMClientError``."""


def install_validation(config: AdapterConfig) -> None:
    """Wraps vLLM's xgrammar validation in this process (idempotent)."""
    import importlib

    module: Any = importlib.import_module(_VALIDATION)
    original = module.validate_xgrammar_grammar
    if getattr(original, _MARK, False):
        return
    listings = _Listings(config)

    from vllm.exceptions import VLLMClientError

    class ComputedSchemaBadRequest(VLLMClientError, ValueError):  # type: ignore[misc]
        """vLLM's own client error (HTTP 400; a plain ``ValueError`` raised here is a 500)."""

    @functools.wraps(original)
    def validate_xgrammar_grammar(sampling_params: Any) -> None:
        try:
            lower_for_request(sampling_params, config, listings.evaluators)
        except ComputedSchemaRefused as exc:
            raise ComputedSchemaBadRequest(str(exc)) from None
        original(sampling_params)

    setattr(validate_xgrammar_grammar, _MARK, True)
    module.validate_xgrammar_grammar = validate_xgrammar_grammar


def lower_for_request(
    sampling_params: Any,
    config: AdapterConfig,
    evaluators: Callable[[AdapterConfig, bool], Sequence[EvaluatorSpec]],
) -> None:
    """Lowers and rewrites one request's computed schema (see the module's docstring); leaves
    any other request alone.

    Raises:
        ComputedSchemaRefused: the schema is refused, or the tenant's evaluators cannot be
            listed; the message names the field.
    """
    structured = getattr(sampling_params, "structured_outputs", None)
    schema = getattr(structured, "json", None)
    if structured is None or not needs_lowering(schema):
        return
    text = schema if isinstance(schema, str) else json.dumps(schema)
    extra = dict(getattr(sampling_params, "extra_args", None) or {})
    reading = request_options(extra, (), config, allowed_targets(config))
    tenant = reading.config

    def listed(refresh: bool) -> Sequence[EvaluatorSpec]:
        if reading.refusal is not None:
            raise EvaluatorsUnavailable(f"{reading.refusal[0]}: {reading.refusal[1]}")
        return evaluators(tenant, refresh)

    operands = extra.get(EXTRA_ARG_OPERANDS)
    try:
        lowered = lower_request_schema(
            text, listed, operands if isinstance(operands, str) else None
        )
    except ComputedSchemaError as exc:
        raise ComputedSchemaRefused(str(exc)) from None
    plan = lowered.computed
    assert plan is not None
    structured.json = None
    structured.grammar = plan.ebnf
    extra[COMPUTED_ARG] = {
        "schema": text,
        "evaluators": [_manifest(spec) for spec in lowered.evaluators],
    }
    sampling_params.extra_args = extra


def computed_plan(sampling_params: Any) -> ComputedPlan | None:
    """The plan of a request the API server lowered, rebuilt in the scheduler; None for any
    other request. Plans are shared by requests that carry the same schema, manifests, operands
    text and grammar (a rebuild costs the scheduler's thread milliseconds; a hit, nothing).

    Raises:
        ValueError: ``evald_computed`` is malformed or does not lower to the request's grammar.
    """
    extra = getattr(sampling_params, "extra_args", None)
    carried = extra.get(COMPUTED_ARG) if isinstance(extra, Mapping) else None
    if carried is None:
        return None
    if not isinstance(carried, Mapping) or not isinstance(carried.get("schema"), str):
        raise ValueError(f"{COMPUTED_ARG} is not what the API server writes")
    operands = extra.get(EXTRA_ARG_OPERANDS) if isinstance(extra, Mapping) else None
    grammar = getattr(getattr(sampling_params, "structured_outputs", None), "grammar", None)
    return _rebuilt(
        carried["schema"],
        json.dumps(carried.get("evaluators") or [], sort_keys=True),
        operands if isinstance(operands, str) else None,
        grammar if isinstance(grammar, str) else None,
    )


@functools.lru_cache(maxsize=256)
def _rebuilt(
    schema: str, manifests: str, operands: str | None, grammar: str | None
) -> ComputedPlan | None:
    specs = [EvaluatorSpec.from_manifest(m) for m in json.loads(manifests)]
    plan = lower_computed_schema(schema, specs, operands_from=operands).computed
    if plan is None or plan.ebnf != grammar:
        raise ValueError(f"{COMPUTED_ARG} does not lower to the request's grammar")
    return plan if plan.fields else None


def _manifest(spec: EvaluatorSpec) -> dict[str, Any]:
    """What :meth:`EvaluatorSpec.from_manifest` reads back into the same spec (for lowering)."""
    return {
        "name": spec.name,
        "tag": spec.tag,
        "input_grammar": spec.input_grammar,
        "result_regex": spec.result_regex,
        "version": spec.version,
        "semantics_version": spec.semantics_version,
        "literals": dict(spec.literals),
        "input_schema": spec.input_schema,
        "result_schema": spec.result_schema,
    }


class _Listings:
    """The API server's tenants' evaluators, held ``evaluators_ttl_s`` per (target, token)."""

    def __init__(self, config: AdapterConfig) -> None:
        self._config = config
        self._held: dict[tuple[str, str | None], tuple[float, list[EvaluatorSpec]]] = {}
        self._lock = threading.Lock()

    def evaluators(self, tenant: AdapterConfig, refresh: bool) -> Sequence[EvaluatorSpec]:
        from engine_adapter.evaluation import evaluator_listing

        key = (tenant.target, tenant.token)
        now = time.monotonic()
        with self._lock:
            held = self._held.get(key)
        if held is not None and not refresh and now - held[0] < self._config.evaluators_ttl_s:
            return held[1]
        try:
            specs, _ = evaluator_listing(
                tenant.target,
                tenant.token,
                timeout_s=LISTING_TIMEOUT_S,
                tls_ca=tenant.tls_ca,
                tls_cert=tenant.tls_cert,
                tls_key=tenant.tls_key,
            )
        except Exception as exc:  # CallError, or anything the transport raises
            message = f"ListEvaluators at {tenant.target} failed: {exc}"
            raise EvaluatorsUnavailable(message) from None
        with self._lock:
            if len(self._held) > 1024:  # many tenants: forget the oldest answers
                self._held.clear()
            self._held[key] = (now, specs)
        return specs
