"""A server request's JSON schema with computed properties, lowered where the server compiles it.

A user sends the structured-output request they already send (SGLang's ``json_schema``, vLLM's
``structured_outputs={"json": …}``, ``response_format`` with a JSON schema on either OpenAI
API) with ``computed`` / ``extracted`` keywords in the schema (docs/computed-fields.md). Unlike
evaluated spans, which the client lowers, such a schema reaches the server as written: the
server lowers it with the request's tenant's evaluators when it compiles the grammar, so a
plain HTTP client needs no library. Both plugins call :func:`lower_request_schema` there and
compile :attr:`ComputedPlan.ebnf <engine_adapter.spans.ComputedPlan>` in place of the schema.

Engine-neutral: nothing here imports an engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine_adapter.spans import (
    COMPUTED_KEYWORD,
    EXTRACTED_KEYWORD,
    ComputedSchemaError,
    EvaluatorSpec,
    EvaluatorsUnavailable,
    SpanGrammar,
    lower_computed_schema,
)

__all__ = ["lower_request_schema", "needs_lowering"]

_KEYWORDS = (COMPUTED_KEYWORD, EXTRACTED_KEYWORD)
_QUOTED = tuple(f'"{keyword}"' for keyword in _KEYWORDS)


def needs_lowering(schema: str | Mapping[str, Any] | None) -> bool:
    """Whether a request's JSON schema (text or dict) marks a property ``computed`` or
    ``extracted``: only such a schema is the adapter's; any other is left to the engine.

    Cheap for the common case: text that does not even contain a keyword is not parsed.
    """
    if schema is None:
        return False
    if isinstance(schema, str):
        if not any(quoted in schema for quoted in _QUOTED):
            return False
        try:
            schema = json.loads(schema)
        except ValueError:
            return False  # the engine's own compile reports bad JSON
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            properties = node.get("properties")
            if isinstance(properties, Mapping) and any(
                isinstance(child, Mapping) and any(k in child for k in _KEYWORDS)
                for child in properties.values()
            ):
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def lower_request_schema(
    schema: str,
    evaluators: Callable[[bool], Sequence[EvaluatorSpec]],
    operands_from: str | None = None,
) -> SpanGrammar:
    """Lowers a request's schema with its tenant's evaluators (see
    :func:`engine_adapter.spans.lower_computed_schema`).

    Parameters:
        schema: the request's JSON schema, as the engine holds it (JSON text).
        evaluators: the tenant's evaluators (``AdapterRuntime.evaluators``); called with
            ``True`` once more after an unknown evaluator name, which may have been
            registered since the held list was read.
        operands_from: the request's ``evald_operands_from`` text, for ``extracted``.

    Raises:
        ComputedSchemaError: the schema is refused (``.path`` names the field), or the
            tenant's evaluators cannot be listed (path ``/``; the message says why).
    """
    specs = _specs(evaluators, refresh=False)
    try:
        return lower_computed_schema(schema, specs, operands_from=operands_from)
    except ComputedSchemaError as exc:
        if "unknown evaluator" not in exc.message:
            raise
    specs = _specs(evaluators, refresh=True)
    return lower_computed_schema(schema, specs, operands_from=operands_from)


def _specs(
    evaluators: Callable[[bool], Sequence[EvaluatorSpec]], *, refresh: bool
) -> Sequence[EvaluatorSpec]:
    try:
        return evaluators(refresh)
    except EvaluatorsUnavailable as exc:
        raise ComputedSchemaError(
            "/", f"cannot list the tenant's evaluators for the computed properties: {exc}"
        ) from None
