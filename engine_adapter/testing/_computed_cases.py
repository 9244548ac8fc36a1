"""Computed-field requests the real-server tests send to SGLang and vLLM alike, and the check
every answer must pass (docs/computed-fields.md).

The schemas keep SmolLM2-135M on rails (patterns, bounds, short strings), so the model always
writes a document the evaluator can read; the values come from the real daemon.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ECHO",
    "ESSAY_PROMPT",
    "ESSAY_SCHEMA",
    "NARRATED_SCHEMA",
    "POLICY",
    "VERDICT",
    "calc_value",
    "checked_document",
    "extraction_schema",
    "http_error",
    "numbers_in",
    "policy_schema",
    "unknown_evaluator_schema",
]

#: The essay's example: ``answer`` computed by ``calc`` from ``expression``.
ESSAY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "expression": {"type": "string", "pattern": "^[1-9][0-9]{1,2} [*] [1-9][0-9]{1,2}$"},
        "answer": {"type": "number", "computed": {"by": "calc", "from": "/expression"}},
    },
    "required": ["expression", "answer"],
}
#: The essay's schema with a property the model writes after the computed value, so a stream
#: goes on after the value has arrived (without it the value's region and the end of the
#: document arrive in one chunk).
NARRATED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        **ESSAY_SCHEMA["properties"],
        "comment": {"type": "string", "pattern": "^[A-Za-z ]{1,24}$"},
    },
    "required": ["expression", "answer", "comment"],
}
#: No answer in the prompt to copy: a model that wrote the value itself would get a product of
#: two- or three-digit numbers wrong far more often than not.
ESSAY_PROMPT = 'Write a product of two numbers as JSON with "expression" and "answer".\nJSON: '


#: What the booking policy registered by the tests decides, whatever the facts (a policy module
#: that returns a fixed object): a value no model writes unforced.
VERDICT = {"total": 7700, "action": "book_appointment", "reason": "eligible"}


def policy_schema(echo: str, policy: str) -> dict[str, Any]:
    """A booking-style document: the model writes the facts; ``echo`` gets them as one JSON
    object (``{"age": 34, "components": [6500, 1200]}``) and returns it, forced as ``facts``
    (the input the engine built, checkable); ``policy`` returns its decision object, forced as
    ``decision``; the model writes the reply after them."""
    components = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 99999}}
    inputs = {"age": "/age", "components": "/components"}
    return {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 1, "maximum": 120},
            "components": {**components, "minItems": 1, "maxItems": 3},
            "facts": {
                "type": "object",
                "properties": {"age": {"type": "integer"}, "components": components},
                "required": ["age", "components"],
                "computed": {"by": echo, "from": inputs},
            },
            "decision": {
                "type": "object",
                "properties": {
                    "action": {"enum": ["book_appointment", "offer_alternative", "decline"]},
                    "reason": {"type": "string"},
                    "total": {"type": "integer"},
                },
                "required": ["action", "reason", "total"],
                "computed": {"by": policy, "from": inputs},
            },
            "reply": {"type": "string", "pattern": "^[A-Za-z ,.]{1,40}$"},
        },
        "required": ["age", "components", "facts", "decision", "reply"],
    }


def extraction_schema() -> dict[str, Any]:
    """``n`` narrowed to the literals of the request's operands text, ``same`` computed from it
    by ``calc`` (its value is the number itself)."""
    return {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "extracted": True},
            "same": {"type": "number", "computed": {"by": "calc", "from": "/n"}},
        },
        "required": ["n", "same"],
    }


def unknown_evaluator_schema() -> dict[str, Any]:
    """The essay's schema with an evaluator no tenant has."""
    schema: dict[str, Any] = json.loads(json.dumps(ESSAY_SCHEMA))
    schema["properties"]["answer"]["computed"]["by"] = "no_such_evaluator"
    return schema


def checked_document(text: str, schema: Mapping[str, Any], specs: Sequence[Any]) -> Any:
    """The JSON document ``text``, checked: it parses, it is written compactly with XGrammar's
    separators (``", "`` and ``": "``, no free whitespace), and it validates against the
    lowered schema (the request's plus the ``{"$error": CODE}`` alternative).

    Raises:
        AssertionError: names what is wrong.
    """
    import jsonschema

    from engine_adapter.spans import lower_computed_schema

    try:
        document = json.loads(text)
    except ValueError as exc:
        raise AssertionError(f"not JSON ({exc}): {text!r}") from None
    assert text == json.dumps(document, ensure_ascii=False), f"not compact: {text!r}"
    plan = lower_computed_schema(schema, specs).computed
    assert plan is not None
    try:
        jsonschema.validate(document, plan.schema)
    except jsonschema.ValidationError as exc:
        raise AssertionError(f"{text!r} does not validate: {exc.message}") from None
    return document


def numbers_in(text: str) -> set[int]:
    """The integers written in ``text``."""
    return {int(m) for m in re.findall(r"\d+", text)}


#: What the per-request tenant registers (tests/engine_adapter/computed_tenant.py): an evaluator
#: that returns its input object (the facts the model wrote, as the engine built them) and a
#: booking policy that returns ``VERDICT``.
ECHO, POLICY = "facts46", "policy46"


def calc_value(target: str, token: str, expression: str) -> Any:
    """evald's own value for ``expression`` (as JSON), or its error object."""
    from evald.client import Client
    from evald.contract import ErrorCode

    with Client(target, token) as client:
        response = client.evaluate("calc", expression)
    if response.WhichOneof("outcome") == "value":
        return json.loads(response.value)
    return {"$error": ErrorCode.from_proto(response.error.code).value}


def http_error(call: Any) -> str:
    """The HTTP error ``call`` raised (``engine_adapter.testing.post``: "HTTP CODE: body")."""
    try:
        answer = call()
    except AssertionError as exc:
        return str(exc)
    raise AssertionError(f"expected an HTTP error, got {answer}")
