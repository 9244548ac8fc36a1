"""The manifest's optional ``input_schema`` and ``result_schema`` (docs/abi.md, Manifest).

A policy evaluator reads one JSON value and returns one; its manifest may say what those are
as JSON Schemas, so a client (the engine adapter's computed fields) can check, before it asks,
that its inputs fit the evaluator and that the property it fills accepts every value the
evaluator can return, and ``evald test`` can hold the module's examples and values to them.

A schema is checked where the manifest is: by the daemon at registration and by ``evald
build``, so a listed schema is always one a client can use. It must be a JSON object, a valid
JSON Schema (its own ``$schema`` dialect, else Draft 2020-12, checked against the dialect's
metaschema with the pinned ``jsonschema``), nested at most :data:`MAX_SCHEMA_DEPTH` levels
and at most :data:`MAX_SCHEMA_BYTES` as compact JSON: a client validates against it on every
request, so an unbounded one would be a cost every caller pays.
"""

from __future__ import annotations

import json
from typing import Any, Final

from evald.contract._errors import ErrorCode, EvaldError

__all__ = ["MAX_SCHEMA_BYTES", "MAX_SCHEMA_DEPTH", "SCHEMA_FIELDS", "parse_schema", "schema_text"]

#: The optional manifest fields that hold a JSON Schema.
SCHEMA_FIELDS: Final = ("input_schema", "result_schema")
#: The largest schema, as compact JSON (the whole manifest is at most 64 KiB).
MAX_SCHEMA_BYTES: Final = 16 * 1024
#: The deepest nesting of objects and arrays in a schema.
MAX_SCHEMA_DEPTH: Final = 32


def _refuse(message: str) -> EvaldError:
    return EvaldError(ErrorCode.INVALID_MODULE, message)


def _depth(value: Any, limit: int) -> int:
    """How deeply ``value`` nests, counting no further than ``limit + 1`` (no recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if not isinstance(item, dict | list):
            continue
        deepest = max(deepest, level)
        if level > limit:
            return level
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, level + 1) for child in children)
    return deepest


def schema_text(schema: dict[str, Any] | None) -> str:
    """A schema as compact JSON text (how ``EvaluatorInfo`` carries it); ``""`` for none."""
    if schema is None:
        return ""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def parse_schema(name: str, raw: Any) -> dict[str, Any] | None:
    """Checks one optional schema field of a manifest; ``None`` when absent.

    Raises:
        EvaldError: ``INVALID_MODULE`` naming the field and what is wrong with it.
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _refuse(
            f"manifest field {name} must be a JSON Schema object such as "
            f'{{"type": "object"}}, not {type(raw).__name__}'
        )
    size = len(schema_text(raw).encode())
    if size > MAX_SCHEMA_BYTES:
        raise _refuse(
            f"manifest field {name} is {size} bytes as compact JSON; a schema may be at most "
            f"{MAX_SCHEMA_BYTES} bytes"
        )
    if _depth(raw, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise _refuse(
            f"manifest field {name} nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} "
            "levels; flatten it (a $defs entry and $ref count one level)"
        )
    from jsonschema import exceptions, validators  # imported only for a manifest that has one

    try:
        validator = validators.validator_for(raw, default=validators.Draft202012Validator)
        validator.check_schema(raw)
    except exceptions.SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path)
        at = f" at /{where}" if where else ""
        raise _refuse(
            f"manifest field {name} is not a valid JSON Schema{at}: {error.message}"
        ) from None
    return raw
