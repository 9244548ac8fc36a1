"""``"extracted": true``: a property narrowed to the literals of the request's text, as span
operands are (docs/computed-fields.md, "Extraction narrowed to the text's literals").

Each number or string place of the property's schema (through unions and array items) becomes
an ``enum`` of the text's literals its own schema accepts; a place the text has nothing for
keeps its schema, and the report says why.
"""

from __future__ import annotations

import json
from typing import Any

from engine_adapter.spans._computed_values import strict_schema
from engine_adapter.spans._operands import (
    MAX_CANDIDATES_PER_RULE,
    MAX_LITERALS_PER_RULE,
    EvaluatorOperands,
    bounded_text,
    literals_in_text,
)

__all__ = ["narrow_extracted"]

_SCALAR_KINDS = {"number": "number", "integer": "number", "string": "string"}


def _literal_value(literal: str) -> Any:
    """A literal of the text as a JSON value: a JSON string, or a number written as the text
    writes it (``07`` and ``00`` are 7 and 0: JSON itself has no leading zeros)."""
    try:
        return json.loads(literal)
    except ValueError:
        pass
    try:
        return int(literal)
    except ValueError:
        pass
    try:
        return float(literal)
    except ValueError:
        return None


def narrow_extracted(
    schema: dict[str, Any], text: str, at: str
) -> tuple[dict[str, Any], EvaluatorOperands]:
    """``schema`` with each number or string place narrowed to the literals of ``text``."""
    text, cut = bounded_text(text)
    found: dict[str, tuple[str, ...]] = {}
    reasons: list[str] = []
    narrowed = _narrow_node(schema, text, at, found, reasons)
    bounded = f"literals read from the first {len(text)} characters of the text" if cut else ""
    return narrowed, EvaluatorOperands(at, found, "; ".join(reasons), bounded=bounded)


def _narrow_node(
    node: dict[str, Any], text: str, at: str, found: dict[str, tuple[str, ...]],
    reasons: list[str],
) -> dict[str, Any]:  # fmt: skip
    for union in ("anyOf", "oneOf"):
        if isinstance(node.get(union), list):
            out = dict(node)
            out[union] = [
                _narrow_node(b, text, f"{at}/{union}/{i}", found, reasons)
                if isinstance(b, dict)
                else b
                for i, b in enumerate(node[union])
            ]
            return out
    kind = node.get("type")
    if kind == "array" and isinstance(node.get("items"), dict):
        return {**node, "items": _narrow_node(node["items"], text, f"{at}/items", found, reasons)}
    literal_kind = _SCALAR_KINDS.get(kind) if isinstance(kind, str) else None
    if literal_kind is None:
        return node
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(strict_schema(node))
    kept: list[Any] = []
    for literal in literals_in_text(literal_kind, text)[:MAX_CANDIDATES_PER_RULE]:
        value = _literal_value(literal)
        if value is None:
            continue
        if kind == "integer" and isinstance(value, float):
            if not value.is_integer():
                continue
            value = int(value)
        if validator.is_valid(value) and value not in kept:
            kept.append(value)
            if len(kept) == MAX_LITERALS_PER_RULE:
                break
    if not kept:
        reasons.append(f"{at}: the text holds no {kind} this property accepts")
        return node
    found[at] = tuple(json.dumps(v, ensure_ascii=False) for v in kept)
    keep = {k: v for k, v in node.items() if k in ("description", "title")}
    return {**keep, "enum": kept}
