"""The walk behind :func:`engine_adapter.spans.lower_computed_schema`: reads every computed and
extracted property of a schema, checks it, and writes the lowered schema.

Computed properties are followed through ``properties`` from the root only: that is where the
text's own structure says, without a guess, when a value is due. Everything else that holds
one (an array's items, a union's branch, a definition) is refused with its pointer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from engine_adapter.spans._computed_extracted import narrow_extracted
from engine_adapter.spans._computed_schema import (
    COMPUTED_KEYWORD,
    EXTRACTED_KEYWORD,
    MAX_SCHEMA_BYTES,
    ComputedField,
    ComputedPlan,
    ComputedSchemaError,
    json_pointer,
    parse_pointer,
)
from engine_adapter.spans._computed_values import (
    ERROR_SCHEMA,
    ValueCheck,
    check_result_schema,
    deep_copy,
)
from engine_adapter.spans._grammar import EvaluatorSpec, Mode, SpanGrammar
from engine_adapter.spans._operands import (
    EvaluatorOperands,
    OperandNarrowing,
)

__all__ = ["Lowering", "lower_computed_schema"]

_KEYWORDS = (COMPUTED_KEYWORD, EXTRACTED_KEYWORD)
_SCALAR_KINDS = {"number": "number", "integer": "number", "string": "string"}


def lower_computed_schema(
    schema: Mapping[str, Any] | str,
    evaluators: Sequence[EvaluatorSpec],
    *,
    operands_from: str | None = None,
) -> SpanGrammar:
    """Checks a schema with computed properties and lowers it for generation.

    Parameters:
        schema: the request's JSON schema (dict or JSON text); its root is an object.
        evaluators: the evaluators the request may use (``ListEvaluators``), by name or tag.
        operands_from: the text whose literals ``"extracted": true`` properties are narrowed to
            (typically the user's message); without it such properties keep their schema and
            :attr:`SpanGrammar.operands` says why.

    Returns:
        A :class:`SpanGrammar` whose structural tag is the lowered grammar and whose
        ``computed`` is the :class:`ComputedPlan` (no span bindings).

    Raises:
        ComputedSchemaError: names the bad field as a JSON pointer into ``schema``.
    """
    if isinstance(schema, str):
        if len(schema.encode()) > MAX_SCHEMA_BYTES:
            raise ComputedSchemaError("/", f"the schema is over {MAX_SCHEMA_BYTES} bytes")
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ComputedSchemaError("/", f"not valid JSON: {exc}") from None
    if not isinstance(schema, Mapping):
        raise ComputedSchemaError("/", f"expected a JSON object, got {type(schema).__name__}")
    lowering = Lowering(evaluators, operands_from)
    lowered, plan = lowering.run(dict(schema))
    ebnf = _grammar(lowered)
    plan = ComputedPlan(plan.fields, plan.objects, lowered, ebnf)
    tag = {"type": "structural_tag", "format": {"type": "grammar", "grammar": ebnf}}
    operands = OperandNarrowing(tuple(lowering.operands)) if lowering.operands else None
    used = tuple(dict.fromkeys(lowering.used))
    return SpanGrammar(tag, (), Mode.GRAMMAR_EVAL, used, operands, computed=plan)


def _grammar(lowered: Mapping[str, Any]) -> str:
    """The lowered schema as XGrammar EBNF, with the fixed separators the plan forces."""
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(lowered), any_whitespace=False, separators=(", ", ": "), strict_mode=True
        )
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ComputedSchemaError("/", f"XGrammar cannot compile the schema: {exc}") from None
    return str(grammar)


class Lowering:
    """One schema's lowering (single use)."""

    def __init__(self, evaluators: Sequence[EvaluatorSpec], operands_from: str | None) -> None:
        self.by_name: dict[str, EvaluatorSpec] = {}
        for spec in evaluators:
            self.by_name.setdefault(spec.tag, spec)
        for spec in evaluators:
            self.by_name[spec.name] = spec
        self.operands_from = operands_from
        self.operands: list[EvaluatorOperands] = []
        self.used: list[EvaluatorSpec] = []
        self.fields: list[ComputedField] = []
        self.objects: dict[tuple[str, ...], tuple[str, ...]] = {}
        self.required: dict[tuple[str, ...], set[str]] = {}
        self.schema_at: dict[tuple[str, ...], Mapping[str, Any]] = {}
        self.seen: set[str] = set()
        """Schema pointers of the computed properties the walk reached."""
        self.source_at: list[str] = []
        """Per field (in order), the pointer of its ``computed`` object in the schema."""

    def run(self, schema: dict[str, Any]) -> tuple[dict[str, Any], ComputedPlan]:
        lowered = deep_copy(schema)
        if lowered.get("type", "object") != "object" or not isinstance(
            lowered.get("properties"), Mapping
        ):
            raise ComputedSchemaError("/type", "the root must be an object schema with properties")
        self._object(lowered, (), "")
        self._refuse_unreached(schema, "")
        self._check_cycles(self.fields)
        self.fields = [
            self._finish(f, at) for f, at in zip(self.fields, self.source_at, strict=True)
        ]
        lowered = _strip(lowered)
        plan = ComputedPlan(tuple(self.fields), dict(self.objects), lowered)
        return lowered, plan

    # ------------------------------------------------------------------ the walk

    def _object(self, node: dict[str, Any], path: tuple[str, ...], at: str) -> None:
        properties = node["properties"]
        required = node.setdefault("required", [])
        if not isinstance(required, list):
            raise ComputedSchemaError(f"{at}/required", "must be a list of property names")
        has_computed = any(
            isinstance(s, Mapping) and COMPUTED_KEYWORD in s for s in properties.values()
        )
        if has_computed and node.get("additionalProperties", False) is not False:
            raise ComputedSchemaError(
                f"{at}/additionalProperties",
                "an object with computed properties must not allow other properties "
                "(drop additionalProperties or set it to false)",
            )
        if has_computed and "patternProperties" in node:
            raise ComputedSchemaError(
                f"{at}/patternProperties", "an object with computed properties cannot have them"
            )
        self.objects[path] = tuple(properties)
        self.schema_at[path] = node
        for key in list(properties):
            child = properties[key]
            child_at = f"{at}/properties/{json_pointer([key])[1:]}"
            if not isinstance(child, dict):
                continue
            if COMPUTED_KEYWORD in child:
                properties[key] = self._computed(child, (*path, key), child_at)
                if key not in required:
                    required.append(key)
            else:
                if EXTRACTED_KEYWORD in child:
                    properties[key] = self._extracted(child, child_at)
                elif (
                    isinstance(child.get("properties"), Mapping)
                    and child.get("type", "object") == "object"
                ):
                    self._object(child, (*path, key), child_at)
        self.required[path] = set(required)

    def _computed(self, node: dict[str, Any], path: tuple[str, ...], at: str) -> dict[str, Any]:
        self.seen.add(at)
        spec_at = f"{at}/{COMPUTED_KEYWORD}"
        spec = node[COMPUTED_KEYWORD]
        if not isinstance(spec, Mapping):
            raise ComputedSchemaError(spec_at, 'must be an object {"by": …, "from": …}')
        unknown = sorted(set(spec) - {"by", "from"})
        if unknown:
            raise ComputedSchemaError(
                f"{spec_at}/{unknown[0]}", "unknown field (allowed: by, from)"
            )
        name = spec.get("by")
        if not isinstance(name, str) or not name:
            raise ComputedSchemaError(f"{spec_at}/by", "missing: the evaluator's name")
        evaluator = self.by_name.get(name)
        if evaluator is None:
            known = ", ".join(sorted({s.name for s in self.by_name.values()})) or "none"
            raise ComputedSchemaError(
                f"{spec_at}/by", f"unknown evaluator {name!r} (available: {known})"
            )
        if EXTRACTED_KEYWORD in node:
            raise ComputedSchemaError(
                f"{at}/{EXTRACTED_KEYWORD}", "a computed property is not extracted from text"
            )
        declared = {k: v for k, v in node.items() if k not in _KEYWORDS}
        inner = _find_keyword(declared, COMPUTED_KEYWORD, at)
        if inner is not None:
            raise ComputedSchemaError(
                inner, "a computed property's own value cannot hold another computed property"
            )
        form, sources = _sources(spec.get("from"), f"{spec_at}/from")
        if evaluator.result_schema is not None:
            problem = check_result_schema(declared, evaluator.result_schema)
            if problem is not None:
                raise ComputedSchemaError(f"{spec_at}/by", f"{evaluator.name}: {problem}")
        if evaluator.input_schema is not None and form == "object":
            _check_input_names(evaluator, sources, f"{spec_at}/from")
        self.used.append(evaluator)
        self.fields.append(
            ComputedField(
                path=path,
                evaluator=evaluator.name,
                sources=sources,
                form=form,
                schema=declared,
                input_schema=evaluator.input_schema,
            )
        )
        self.source_at.append(spec_at)
        return {"anyOf": [declared, dict(ERROR_SCHEMA)]}

    def _extracted(self, node: dict[str, Any], at: str) -> dict[str, Any]:
        flag = node[EXTRACTED_KEYWORD]
        if not isinstance(flag, bool):
            raise ComputedSchemaError(f"{at}/{EXTRACTED_KEYWORD}", "must be true or false")
        plain = {k: v for k, v in node.items() if k != EXTRACTED_KEYWORD}
        if not flag:
            return plain
        if self.operands_from is None:
            self.operands.append(
                EvaluatorOperands(at, reason="no text to read literals from (operands_from)")
            )
            return plain
        narrowed, report = narrow_extracted(plain, self.operands_from, at)
        self.operands.append(report)
        return narrowed

    def _refuse_unreached(self, node: Any, at: str) -> None:
        """A computed property the walk did not reach is one the text cannot place."""
        if isinstance(node, list):
            for i, item in enumerate(node):
                self._refuse_unreached(item, f"{at}/{i}")
            return
        if not isinstance(node, Mapping):
            return
        properties = node.get("properties")
        if isinstance(properties, Mapping):
            for key, child in properties.items():
                child_at = f"{at}/properties/{json_pointer([key])[1:]}"
                if isinstance(child, Mapping) and COMPUTED_KEYWORD in child:
                    if child_at not in self.seen:
                        raise ComputedSchemaError(
                            f"{child_at}/{COMPUTED_KEYWORD}",
                            "a computed property must be reached from the root through "
                            "'properties' only (not inside items, anyOf, oneOf, allOf, $defs, "
                            "$ref or additionalProperties): the adapter could not tell from "
                            "the text when its value is due",
                        )
        for key, value in node.items():
            if key in ("properties",) and isinstance(value, Mapping):
                for name, child in value.items():
                    self._refuse_unreached(child, f"{at}/properties/{json_pointer([name])[1:]}")
            elif key not in _KEYWORDS:
                self._refuse_unreached(value, f"{at}/{json_pointer([key])[1:]}")

    # ------------------------------------------------------------------ the checks

    def _check_cycles(self, fields: list[ComputedField]) -> None:
        by_path = {f.path: i for i, f in enumerate(fields)}
        graph: dict[int, list[int]] = {}
        for i, f in enumerate(fields):
            graph[i] = [
                by_path[target[:n]]
                for _, target in f.sources
                for n in range(1, len(target) + 1)
                if target[:n] in by_path
            ]
        state: dict[int, int] = {}

        def visit(node: int, trail: list[int]) -> None:
            state[node] = 1
            for nxt in graph[node]:
                if nxt == node:
                    raise ComputedSchemaError(
                        f"{self.source_at[node]}/from",
                        f"{fields[node].pointer} is computed from itself",
                    )
                if state.get(nxt) == 1:
                    loop = [*trail[trail.index(nxt) :], nxt] if nxt in trail else [node, nxt]
                    names = " -> ".join(fields[i].pointer for i in loop)
                    raise ComputedSchemaError(
                        f"{self.source_at[node]}/from",
                        f"circular: {names} (each is computed from the next)",
                    )
                if state.get(nxt) is None:
                    visit(nxt, [*trail, nxt])
            state[node] = 2

        for i in range(len(fields)):
            if state.get(i) is None:
                visit(i, [i])

    def _finish(self, field: ComputedField, at: str) -> ComputedField:
        """Checks each input's pointer against the document's order; sets the delimiter."""
        for name, target in field.sources:
            where = f"{at}/from" + (f"/{json_pointer([name])[1:]}" if name else "")
            source = self._check_source(field.path, target, where)
            accepted = _input_schema_for(field, name)
            if accepted is not None:
                _check_bounds(source, accepted, field.evaluator, json_pointer(target), where)
        ValueCheck(field.schema)  # compiles its validator and grammar now, not mid-generation
        return ComputedField(
            path=field.path,
            evaluator=field.evaluator,
            sources=field.sources,
            form=field.form,
            schema=field.schema,
            delimiter=self._delimiter(field, at),
            input_schema=field.input_schema,
        )

    def _check_source(self, computed: tuple[str, ...], target: tuple[str, ...], at: str) -> Any:
        """The schema of the input at ``target``; refuses a pointer that is not written yet."""
        shown = json_pointer(target) or "/"
        common = 0
        while common < min(len(target), len(computed)) and target[common] == computed[common]:
            common += 1
        if common == len(computed):
            raise ComputedSchemaError(at, f"{shown} is the computed property itself or inside it")
        if common == len(target):
            raise ComputedSchemaError(
                at, f"{shown} holds the computed property, so it is not complete when the "
                "value is due",
            )  # fmt: skip
        parent = target[:common]
        keys = self.objects.get(parent)
        if keys is None or target[common] not in keys:
            raise ComputedSchemaError(at, f"{shown} points to nothing in the schema")
        mine, theirs = keys.index(computed[common]), keys.index(target[common])
        if theirs > mine:
            raise ComputedSchemaError(
                at,
                f"{shown} comes after {json_pointer(computed[: common + 1])} in the schema's "
                "property order, so it is not written yet when the value is due: move it "
                "before",
            )
        node: Any = self.schema_at[parent]["properties"][target[common]]
        for part in target[common + 1 :]:
            node = _child(node, part)
            if node is None:
                raise ComputedSchemaError(at, f"{shown} points to nothing in the schema")
        return node

    def _delimiter(self, field: ComputedField, at: str) -> str:
        """``,`` or ``}`` after a value a digit could extend; refused when neither is fixed."""
        if not _may_be_number(field.schema):
            return ""
        parent, key = field.path[:-1], field.key
        keys = self.objects[parent]
        later = keys[keys.index(key) + 1 :]
        if not later:
            return "}"
        if any(k in self.required[parent] for k in later):
            return ","
        raise ComputedSchemaError(
            at.removesuffix(f"/{COMPUTED_KEYWORD}"),
            "a computed number must end its object or be followed by a required property "
            f"(make one of {', '.join(later)} required, or move {key!r} last): otherwise the "
            "model could append digits to the forced value",
        )


def _sources(raw: Any, at: str) -> tuple[str, tuple[tuple[str, tuple[str, ...]], ...]]:
    def one(pointer: Any, where: str) -> tuple[str, ...]:
        if not isinstance(pointer, str):
            raise ComputedSchemaError(where, "must be a JSON pointer such as '/expression'")
        try:
            path = parse_pointer(pointer)
        except ValueError as exc:
            raise ComputedSchemaError(where, str(exc)) from None
        if not path:
            raise ComputedSchemaError(where, "'' is the whole document, which holds the value")
        return path

    if raw is None:
        raise ComputedSchemaError(at, "missing: a JSON pointer, or an object of them")
    if isinstance(raw, str):
        return "value", (("", one(raw, at)),)
    if isinstance(raw, Mapping):
        if not raw:
            raise ComputedSchemaError(at, "an empty object: name at least one input")
        return "object", tuple(
            (str(name), one(p, f"{at}/{json_pointer([str(name)])[1:]}")) for name, p in raw.items()
        )
    if isinstance(raw, list):
        if not raw:
            raise ComputedSchemaError(at, "an empty list: give at least one pointer")
        return "array", tuple(("", one(p, f"{at}/{i}")) for i, p in enumerate(raw))
    raise ComputedSchemaError(at, "must be a JSON pointer, an object of them or a list of them")


def _check_input_names(
    evaluator: EvaluatorSpec, sources: tuple[tuple[str, tuple[str, ...]], ...], at: str
) -> None:
    schema = evaluator.input_schema or {}
    properties = schema.get("properties")
    if not isinstance(properties, Mapping):
        return
    names = [name for name, _ in sources]
    if schema.get("additionalProperties", True) is False:
        for name in names:
            if name not in properties:
                raise ComputedSchemaError(
                    f"{at}/{json_pointer([name])[1:]}",
                    f"{evaluator.name} takes no input {name!r} (its inputs: "
                    f"{', '.join(properties)})",
                )
    required = schema.get("required")
    for name in required if isinstance(required, list) else ():
        if name not in names:
            raise ComputedSchemaError(at, f"{evaluator.name} needs the input {name!r}")


_BOUNDS = (("maxLength", "longer"), ("maxItems", "longer"))


def _input_schema_for(field: ComputedField, name: str) -> Mapping[str, Any] | None:
    """What the evaluator's ``input_schema`` accepts for one input (None: no bound known)."""
    schema = field.input_schema
    if not isinstance(schema, Mapping):
        return None
    if field.form == "value":
        return schema
    properties = schema.get("properties")
    if field.form == "object" and isinstance(properties, Mapping):
        sub = properties.get(name)
        return sub if isinstance(sub, Mapping) else None
    return None


def _check_bounds(
    source: Any, accepted: Mapping[str, Any], evaluator: str, shown: str, at: str
) -> None:
    """An input the evaluator's manifest bounds must be bounded at least as tightly by the
    schema, or a value the model may write would be over the evaluator's limits."""
    source = source if isinstance(source, Mapping) else {}
    for keyword, word in _BOUNDS:
        limit = accepted.get(keyword)
        if not isinstance(limit, int):
            continue
        own = source.get(keyword)
        if not isinstance(own, int) or own > limit:
            allows = f"{keyword} {own}" if isinstance(own, int) else f"no {keyword}"
            raise ComputedSchemaError(
                at,
                f"{shown} may be {word} than {evaluator} accepts ({keyword} {limit}); the "
                f'schema has {allows}: bound it with "{keyword}": {limit} or less',
            )


def _child(node: Any, part: str) -> Any:
    if not isinstance(node, Mapping):
        return None
    properties = node.get("properties")
    if isinstance(properties, Mapping) and part in properties:
        return properties[part]
    if part.isdigit() and (node.get("type") == "array" or "items" in node):
        return node.get("items", {})
    for union in ("anyOf", "oneOf"):
        for branch in node.get(union) or ():
            found = _child(branch, part)
            if found is not None:
                return found
    return None


def _may_be_number(schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if kinds:
        return bool(kinds & {"number", "integer"})
    for key in ("enum",):
        values = schema.get(key)
        if isinstance(values, list):
            return any(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if "const" in schema:
        value = schema["const"]
        return isinstance(value, int | float) and not isinstance(value, bool)
    branches = [
        b for u in ("anyOf", "oneOf") for b in schema.get(u) or () if isinstance(b, Mapping)
    ]
    if branches:
        return any(_may_be_number(b) for b in branches)
    return "properties" not in schema and "items" not in schema


def _find_keyword(node: Any, keyword: str, at: str) -> str | None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            found = _find_keyword(item, keyword, f"{at}/{i}")
            if found is not None:
                return found
        return None
    if not isinstance(node, Mapping):
        return None
    for key, value in node.items():
        if key == "properties" and isinstance(value, Mapping):
            for name, child in value.items():
                child_at = f"{at}/properties/{json_pointer([name])[1:]}"
                if isinstance(child, Mapping) and keyword in child:
                    return f"{child_at}/{keyword}"
        found = _find_keyword(value, keyword, f"{at}/{json_pointer([key])[1:]}")
        if found is not None:
            return found
    return None


def _strip(node: Any) -> Any:
    """The lowered schema without the adapter's keywords (XGrammar ignores unknown keywords;
    the servers' validators and the response the user reads need not see them)."""
    if isinstance(node, list):
        return [_strip(item) for item in node]
    if not isinstance(node, Mapping):
        return node
    return {k: _strip(v) for k, v in node.items() if k not in _KEYWORDS}
