"""A ``json_schema`` request with computed properties: lowered, compiled and evaluated.

SGLang reaches ``XGrammarGrammarBackend.dispatch_json`` for its native ``/generate``
``sampling_params.json_schema`` and for the OpenAI API's ``response_format`` of type
``json_schema`` (``ChatCompletionRequest.to_sampling_params`` turns the schema into the same
``json_schema`` text). The plugin's AROUND hook calls :func:`dispatch_computed_json`: a schema
that marks no property ``computed`` or ``extracted`` goes to SGLang's own compile untouched;
one that does is lowered with the request's tenant's evaluators
(:func:`engine_adapter.serving.lower_request_schema`), its EBNF compiled through the backend
(``dispatch_ebnf``), and the grammar wrapped in an :class:`EvaluatorGrammar` that carries the
plan, so the request's state follows the document and forces each computed value.

The request's tenant comes through the cache key as for structural tags
(:mod:`engine_adapter.sglang._tenants`); so does its ``evald_operands_from`` text, which
``extracted`` properties are narrowed to. A refused schema compiles to SGLang's
``InvalidGrammarObject`` with the JSON pointer first in its message; SGLang aborts the request
with HTTP 400 and ``Failed to compile json grammar: /properties/answer/computed/by: …``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine_adapter.serving import AdapterRuntime, lower_request_schema, needs_lowering
from engine_adapter.spans import ComputedSchemaError

__all__ = ["COMPUTED_IN_TAG", "dispatch_computed_json", "keyed_field"]

#: Why a structural tag that holds a computed schema is refused (SGLang's chat API frames a
#: ``json_schema`` in a structural tag when a reasoning parser gates the answer): compiled as
#: it is, XGrammar would ignore the keyword and the model would write the values itself.
COMPUTED_IN_TAG = (
    "evald adapter: computed or extracted properties work in a json_schema request (or a "
    "response_format of type json_schema), not inside a structural tag; with a reasoning "
    "parser SGLang puts the schema in one, so start the server without it for such requests"
)

logger = logging.getLogger("engine_adapter.sglang")


def keyed_field(params: Any) -> str | None:
    """The sampling-params field whose text carries the tenant mark: ``json_schema`` when it
    is the adapter's (SGLang compiles it before any structural tag), else ``structural_tag``
    when set, else None (nothing to key)."""
    schema = getattr(params, "json_schema", None)
    if schema is not None:
        return "json_schema" if needs_lowering(schema) else None
    return "structural_tag" if getattr(params, "structural_tag", None) is not None else None


def dispatch_computed_json(
    original: Callable[[Any, str], Any],
    backend: Any,
    key_string: str,
    default: AdapterRuntime,
    keys: Any,
) -> Any:
    """The grammar for one ``json`` cache key (see the module's docstring).

    Parameters:
        original: SGLang's ``dispatch_json``.
        backend: the ``XGrammarGrammarBackend``.
        key_string: the schema, with the tenant mark when the scheduler hook keyed it.
        default: the server's own tenant's runtime.
        keys: the process's :class:`~engine_adapter.sglang._tenants.TenantKeys`.
    """
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    from engine_adapter.sglang._grammar_object import EvaluatorGrammar
    from engine_adapter.sglang._tenants import split_key

    schema, mark = split_key(key_string)
    if mark is None and not needs_lowering(schema):
        return original(backend, key_string)
    keyed = keys.find(mark) if mark is not None else None
    if mark is not None and keyed is None:
        return InvalidGrammarObject(
            "evald adapter: the request this grammar was for has ended; send it again"
        )
    tenant = keyed.runtime if keyed is not None else default
    operands = keyed.operands_from if keyed is not None else None
    try:
        lowered = lower_request_schema(schema, tenant.evaluators, operands)
    except ComputedSchemaError as exc:
        logger.info("evald adapter: refused a computed JSON schema: %s", exc)
        return InvalidGrammarObject(str(exc))
    plan = lowered.computed
    assert plan is not None
    grammar = backend.dispatch_ebnf(plan.ebnf)
    if isinstance(grammar, InvalidGrammarObject) or not plan.fields:
        return grammar  # ``extracted`` alone needs no evaluation
    return EvaluatorGrammar(grammar, (), tenant, computed=plan)
