"""A computed property's value: read from the evaluator's answer, checked, written as JSON.

The evaluator answers text. The property's declared schema decides what it may hold, so the
answer is read as JSON (``482``, ``{"total": 7700, …}``), or, when that is not JSON or does not
fit, as a JSON string (a ``date`` evaluator's ``2024-07-04``), and must then validate against
the declared schema (JSON Schema, with additional properties closed where the schema does not
open them, as XGrammar's strict mode reads it) and be accepted by the property's own grammar.
What is forced is that value written canonically: object keys in the schema's order, the
grammar's separators ``", "`` and ``": "``, integral numbers without a fraction.

Anything else — an error, a refusal, a late answer, a value that does not fit — is forced as
the error object ``{"$error": CODE}``, the one alternative the lowered schema adds
(docs/computed-fields.md).
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ERROR_CODE_PATTERN",
    "ERROR_KEY",
    "ERROR_SCHEMA",
    "SCHEMA_MISMATCH",
    "ValueCheck",
    "check_result_schema",
    "render_error",
    "render_value",
    "strict_schema",
]

#: The key of the error object forced in place of a value: ``{"$error": "deadline_exceeded"}``.
ERROR_KEY = "$error"
#: The error codes' language (``evald.contract.ErrorCode`` values and the adapter's own).
ERROR_CODE_PATTERN = "^[a-z][a-z0-9_]*$"
#: The one alternative the lowered schema adds to a computed property.
ERROR_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {ERROR_KEY: {"type": "string", "pattern": ERROR_CODE_PATTERN}},
    "required": [ERROR_KEY],
    "additionalProperties": False,
}
#: The adapter's code for a value that its property's declared schema does not accept.
SCHEMA_MISMATCH = "schema_mismatch"

_SEPARATORS = (", ", ": ")


def strict_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say
    otherwise: what XGrammar's strict mode generates, so validation agrees with the grammar."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {key: strict_schema(value) for key, value in schema.items()}
    if ("properties" in out or out.get("type") == "object") and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def render_error(code: str) -> str:
    """The error object's text, as forced."""
    return json.dumps({ERROR_KEY: code}, separators=_SEPARATORS)


def render_value(value: Any, schema: Any) -> str:
    """``value`` as the grammar writes it: keys in the schema's order, fixed separators.

    Raises:
        ValueError: a number JSON cannot write (NaN, infinity).
    """
    return json.dumps(_ordered(value, schema), separators=_SEPARATORS, ensure_ascii=False,
                      allow_nan=False)  # fmt: skip


def _ordered(value: Any, schema: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < 2**63:
            return int(value)
        return value
    if isinstance(value, int):
        return value
    schema = schema if isinstance(schema, Mapping) else {}
    if isinstance(value, list):
        items = schema.get("items")
        return [_ordered(item, items) for item in value]
    if isinstance(value, Mapping):
        branch = _branch_for(value, schema)
        properties = branch.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        keys = [k for k in properties if k in value] + [k for k in value if k not in properties]
        return {k: _ordered(value[k], properties.get(k)) for k in keys}
    return value


def _branch_for(value: Any, schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """The union branch a value validates against (its properties' order is the grammar's)."""
    for union in ("anyOf", "oneOf"):
        branches = schema.get(union)
        if isinstance(branches, list):
            for branch in branches:
                if isinstance(branch, Mapping) and _validator(_key(branch)).is_valid(value):
                    return branch
    return schema


def _key(schema: Any) -> str:
    """The cache key: the schema's JSON in its own key order (property order is grammar)."""
    return json.dumps(schema)


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    from jsonschema import Draft202012Validator

    return Draft202012Validator(strict_schema(json.loads(schema_json)))


@functools.lru_cache(maxsize=256)
def _compiled(schema_json: str) -> Any:
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(
        schema_json, any_whitespace=False, separators=_SEPARATORS, strict_mode=True
    )
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1, cache_enabled=False)
    return compiler.compile_grammar(grammar)


@dataclass(frozen=True)
class ValueCheck:
    """Turns an evaluator's answer into the text forced for one property.

    Built when the schema is lowered (the validator and the property's grammar are compiled
    then, and cached by the schema), used when the answer arrives.
    """

    schema: Mapping[str, Any]

    def __post_init__(self) -> None:
        _validator(_key(self.schema))
        _compiled(_key(self.schema))

    def render(self, answer: str) -> tuple[str | None, str]:
        """``(text, "")`` for an answer the property accepts; ``(None, why)`` otherwise."""
        candidates: list[Any] = []
        try:
            candidates.append(json.loads(answer))
        except ValueError:
            pass
        candidates.append(answer)  # the text itself, as a JSON string
        validator = _validator(_key(self.schema))
        for value in candidates:
            if not validator.is_valid(value):
                continue
            try:
                text = render_value(value, self.schema)
            except ValueError:
                continue
            if self.accepts(text):
                return text, ""
        shown = answer if len(answer) <= 60 else answer[:57] + "..."
        first = next(iter(validator.iter_errors(candidates[0])), None)
        why = f": {first.message}" if first is not None else ""
        return None, f"the value {shown!r} does not fit the property's schema{why}"

    def accepts(self, text: str) -> bool:
        """Whether the property's grammar accepts ``text`` whole (what forcing needs)."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(_compiled(_key(self.schema)),
                                     terminate_without_stop_token=True)  # fmt: skip
        return bool(matcher.accept_string(text)) and bool(matcher.is_terminated())


_TYPE_COVER = {"integer": {"integer", "number"}}


def check_result_schema(declared: Mapping[str, Any], result: Mapping[str, Any]) -> str | None:
    """Why ``declared`` cannot hold every value ``result`` (an evaluator's result schema)
    allows, or None. Conservative: compares types, enums and the properties objects require;
    a pair it cannot compare passes (the value is still checked when it arrives)."""
    declared_types = _types(declared)
    result_types = _types(result)
    if declared_types and result_types:
        uncovered = [t for t in result_types if not _TYPE_COVER.get(t, {t}) & set(declared_types)]
        if uncovered:
            return (
                f"the evaluator returns {', '.join(uncovered)} "
                f"where the property allows {', '.join(declared_types)}"
            )
    declared_enum, result_enum = declared.get("enum"), result.get("enum")
    if isinstance(declared_enum, list) and isinstance(result_enum, list):
        missing = [v for v in result_enum if v not in declared_enum]
        if missing:
            return f"the evaluator may return {missing[0]!r}, which the property's enum lacks"
    declared_props = declared.get("properties")
    result_props = result.get("properties")
    if isinstance(declared_props, Mapping) and isinstance(result_props, Mapping):
        closed = declared.get("additionalProperties", False) is False
        for key, sub in result_props.items():
            if key not in declared_props:
                if closed:
                    return f"the evaluator returns property {key!r}, which the property lacks"
                continue
            if isinstance(sub, Mapping) and isinstance(declared_props[key], Mapping):
                inner = check_result_schema(declared_props[key], sub)
                if inner is not None:
                    return f"in {key!r}: {inner}"
        required = declared.get("required")
        result_required = set(result.get("required") or ())
        for key in required if isinstance(required, list) else ():
            if key not in result_required:
                return f"the property requires {key!r}, which the evaluator may leave out"
    return None


def _types(schema: Mapping[str, Any]) -> list[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [str(k) for k in kind]
    if isinstance(schema.get("anyOf"), list):
        out: list[str] = []
        for branch in schema["anyOf"]:
            if isinstance(branch, Mapping):
                sub = _types(branch)
                if not sub:
                    return []
                out.extend(sub)
        return out
    return []


def deep_copy(schema: Any) -> Any:
    """A copy the lowering may change (the request's schema stays as it was)."""
    return copy.deepcopy(schema)
