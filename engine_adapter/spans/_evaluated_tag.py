"""The ``evaluated_tag`` request format, lowered to plain XGrammar structural-tag formats.

A user who already sends structural tags (JSON schemas, tool calls, other tags) marks an evaluated
span anywhere inside with::

    {"type": "evaluated_tag", "begin": "<calc>", "content": {…optional format…}, "end": "</calc>",
     "evaluator": "calc", "result": {"begin": "<result>", "end": "</result>"},
     "error": {"begin": "<result_error>", "end": "</result_error>"}}      # "error" optional

It is the natural extension of XGrammar's DSL: a tag whose content, once complete, is passed to a
registered pure function, with the return value forced into the sibling region that follows.
:func:`lower_evaluated_tags` replaces each one by a plain ``tag`` (see
:func:`engine_adapter.spans.span_format`), returns the :class:`SpanBinding` list the injector
needs, and adds to every free-text region (``any_text``, ``triggered_tags``, ``dispatch``) the
strings it must not contain (result openers and closers, span closers, and the openers of spans
that region does not itself dispatch), so the model can neither write a result of its own nor open
a span the grammar would not recognise.

Limit: span detection works on the decoded text, so a span opener must not be producible by
formats that have no ``excludes`` (for example a JSON string containing ``<calc>``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from engine_adapter.spans._grammar import (
    EvaluatorSpec,
    Mode,
    SpanGrammar,
    check_bindings,
    free_text_excludes,
    span_format,
)
from engine_adapter.spans._operands import EvaluatorOperands, OperandNarrowing, narrow_grammar
from engine_adapter.spans._types import SpanBinding

__all__ = ["EvaluatedTagError", "contains_evaluated_tag", "lower_evaluated_tags"]

_TYPE = "evaluated_tag"
_KEYS = frozenset(
    {"type", "begin", "content", "end", "evaluator", "result", "error", "operands_from"}
)
_REGION_KEYS = frozenset({"begin", "end"})
_DEFAULT_ERROR = {"begin": "<result_error>", "end": "</result_error>"}
# Free-text formats that take an ``excludes`` list of strings.
_FREE_TEXT = frozenset({"any_text", "triggered_tags", "dispatch"})


class EvaluatedTagError(ValueError):
    """An invalid structural tag. ``path`` is a JSON pointer to the bad field."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path or '/'}: {message}")
        self.path = path or "/"
        self.message = message


def contains_evaluated_tag(tag: Any) -> bool:
    """Whether a structural tag (dict, list or JSON text) contains an ``evaluated_tag`` anywhere.

    Engines call this to decide whether a request needs an injector at all.
    """
    if isinstance(tag, str | bytes):
        try:
            tag = json.loads(tag)
        except ValueError:
            return False
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            if node.get("type") == _TYPE:
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def lower_evaluated_tags(
    tag: Mapping[str, Any] | str,
    evaluators: Sequence[EvaluatorSpec],
    *,
    special_tokens: Sequence[str] = (),
    validate: bool = True,
    operands_from: str | None = None,
) -> SpanGrammar:
    """Lowers every ``evaluated_tag`` inside a structural tag to plain XGrammar formats.

    Parameters:
        tag: ``{"type": "structural_tag", "format": …}`` or a bare format, as a dict or JSON text.
        evaluators: the evaluators the caller may use (``ListEvaluators``); an ``evaluator`` field
            names one by name or by tag.
        special_tokens: extra strings to exclude from every free-text region (chat markers).
        validate: also check the result against XGrammar's own schema (needs ``xgrammar``), so
            a typo anywhere in the tag is reported with its path before compilation.
        operands_from: operands from the context for every ``evaluated_tag`` without a
            ``content`` of its own: its evaluator's literal rules are narrowed to the literals
            of this text (an element's own ``operands_from`` wins). ``SpanGrammar.operands``
            reports what was narrowed.

    Returns:
        A :class:`SpanGrammar` in ``grammar-eval`` mode: the lowered tag (always in the
        ``{"type": "structural_tag", "format": …}`` form) and one binding per distinct span kind.

    Raises:
        EvaluatedTagError: names the bad field as a JSON pointer (``/format/tags/0/evaluator``).
    """
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as exc:
            raise EvaluatedTagError("/", f"not valid JSON: {exc}") from None
    if not isinstance(tag, Mapping):
        raise EvaluatedTagError("/", f"expected a JSON object, got {type(tag).__name__}")
    if tag.get("type") == "structural_tag":
        if "format" not in tag:
            raise EvaluatedTagError("/format", "missing: a structural tag needs a format")
        root, root_path = tag["format"], "/format"
    else:
        root, root_path = tag, ""
    lowering = _Lowering(evaluators, operands_from)
    lowered = lowering.walk(root, root_path, inside_span=None)
    bindings = tuple(lowering.bindings.values())
    excludes = free_text_excludes(bindings, special_tokens) if bindings else list(special_tokens)
    lowered = _add_excludes(lowered, excludes, [b.begin for b in bindings])
    result = {"type": "structural_tag", "format": lowered}
    if validate:
        _validate(result, {"type": "structural_tag", "format": root}, root_path)
    used = tuple(dict.fromkeys(lowering.used))
    operands = OperandNarrowing(tuple(lowering.operands)) if lowering.operands else None
    return SpanGrammar(result, bindings, Mode.GRAMMAR_EVAL, used, operands)


class _Lowering:
    def __init__(self, evaluators: Sequence[EvaluatorSpec], operands_from: str | None) -> None:
        self.operands_from = operands_from
        self.operands: list[EvaluatorOperands] = []
        self.by_name: dict[str, EvaluatorSpec] = {}
        for spec in evaluators:
            self.by_name.setdefault(spec.tag, spec)
        for spec in evaluators:
            self.by_name[spec.name] = spec
        self.bindings: dict[str, SpanBinding] = {}
        self.binding_paths: dict[str, str] = {}
        self.used: list[EvaluatorSpec] = []

    def walk(self, node: Any, path: str, inside_span: str | None) -> Any:
        if isinstance(node, list):
            return [self.walk(item, f"{path}/{i}", inside_span) for i, item in enumerate(node)]
        if not isinstance(node, Mapping):
            return node
        if node.get("type") == _TYPE:
            if inside_span is not None:
                raise EvaluatedTagError(
                    path, f"an evaluated_tag cannot be nested inside another (at {inside_span})"
                )
            return self.lower(node, path)
        return {
            key: self.walk(value, f"{path}/{_escape(key)}", inside_span)
            for key, value in node.items()
        }

    def lower(self, node: Mapping[str, Any], path: str) -> dict[str, Any]:
        unknown = sorted(set(node) - _KEYS)
        if unknown:
            raise EvaluatedTagError(
                f"{path}/{_escape(unknown[0])}",
                f"unknown field of evaluated_tag (allowed: {', '.join(sorted(_KEYS))})",
            )
        begin = _string(node, "begin", path)
        end = _string(node, "end", path)
        name = _string(node, "evaluator", path)
        spec = self.by_name.get(name)
        if spec is None:
            known = ", ".join(sorted({s.name for s in self.by_name.values()})) or "none"
            raise EvaluatedTagError(
                f"{path}/evaluator", f"unknown evaluator {name!r} (available: {known})"
            )
        if "result" not in node:
            raise EvaluatedTagError(
                f"{path}/result", 'missing: give {"begin": "<result>", "end": "</result>"}'
            )
        result = _region(node["result"], f"{path}/result")
        error = _region(node.get("error", _DEFAULT_ERROR), f"{path}/error")
        if result["begin"] == error["begin"]:
            raise EvaluatedTagError(
                f"{path}/error/begin",
                "must differ from result.begin (values and errors must be told apart)",
            )
        if begin in (result["begin"], error["begin"]):
            raise EvaluatedTagError(f"{path}/begin", "must differ from the result region's begin")
        binding = SpanBinding(
            evaluator=spec.name,
            begin=begin,
            end=end,
            result_begin=result["begin"],
            result_end=result["end"],
            error_begin=error["begin"],
            error_end=error["end"],
            result_regex=spec.result_regex,
        )
        self._register(binding, path)
        self.used.append(spec)
        text = node.get("operands_from", self.operands_from)
        if "operands_from" in node and not isinstance(text, str):
            raise EvaluatedTagError(f"{path}/operands_from", "must be a string (the text)")
        if "content" in node and "operands_from" in node:
            raise EvaluatedTagError(
                f"{path}/operands_from",
                "narrows the evaluator's own grammar, so it cannot go with a content of your own",
            )
        if "content" in node:
            content = node["content"]
            if not isinstance(content, Mapping) or not isinstance(content.get("type"), str):
                raise EvaluatedTagError(
                    f"{path}/content", "must be a structural-tag format object with a type"
                )
            content = self.walk(content, f"{path}/content", inside_span=path)
            _validate_format(content, f"{path}/content", node["content"])
        else:
            grammar = spec.input_grammar
            if text is not None:
                narrowed, report = narrow_grammar(grammar, spec.literals, text, spec.name)
                grammar = narrowed or grammar
                self.operands.append(report)
            content = {"type": "grammar", "grammar": grammar}
        return span_format(binding, content, Mode.GRAMMAR_EVAL)

    def _register(self, binding: SpanBinding, path: str) -> None:
        known = self.bindings.get(binding.begin)
        if known is not None:
            if known != binding:
                raise EvaluatedTagError(
                    f"{path}/begin",
                    f"{binding.begin!r} is already used with different settings at "
                    f"{self.binding_paths[binding.begin]}",
                )
            return
        try:
            check_bindings([*self.bindings.values(), binding])
        except ValueError as exc:
            raise EvaluatedTagError(f"{path}/begin", str(exc)) from None
        self.bindings[binding.begin] = binding
        self.binding_paths[binding.begin] = path


def _string(node: Mapping[str, Any], key: str, path: str) -> str:
    value = node.get(key)
    if key not in node:
        raise EvaluatedTagError(f"{path}/{key}", "missing (a non-empty string is required)")
    if not isinstance(value, str) or not value:
        raise EvaluatedTagError(f"{path}/{key}", f"must be a non-empty string, got {value!r}")
    return value


def _region(node: Any, path: str) -> dict[str, str]:
    if not isinstance(node, Mapping):
        raise EvaluatedTagError(path, 'must be an object {"begin": …, "end": …}')
    unknown = sorted(set(node) - _REGION_KEYS)
    if unknown:
        raise EvaluatedTagError(
            f"{path}/{_escape(unknown[0])}", "unknown field (allowed: begin, end)"
        )
    return {"begin": _string(node, "begin", path), "end": _string(node, "end", path)}


def _escape(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _add_excludes(node: Any, excludes: list[str], begins: list[str]) -> Any:
    """Adds the protocol's excludes to every free-text format (a copy; the input is untouched)."""
    if isinstance(node, list):
        return [_add_excludes(item, excludes, begins) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _add_excludes(value, excludes, begins) for key, value in node.items()}
    kind = out.get("type")
    if kind in _FREE_TEXT and (excludes or begins):
        own = set()
        if kind == "triggered_tags":
            own = {t.get("begin") for t in out.get("tags", []) if isinstance(t, dict)}
        elif kind == "dispatch":
            own = {r[0] for r in out.get("rules", []) if isinstance(r, list | tuple) and r}
        extra = [b for b in begins if b not in own and not any(b.startswith(o) for o in own if o)]
        current = out.get("excludes", [])
        if isinstance(current, list):
            out["excludes"] = list(dict.fromkeys([*current, *excludes, *extra]))
    return out


def _validate(lowered: dict[str, Any], original: dict[str, Any], root_path: str) -> None:
    from pydantic import ValidationError
    from xgrammar.structural_tag import StructuralTag

    try:
        StructuralTag.model_validate(lowered)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = _pointer(original, error["loc"]) + _tag_suffix(error)
        if not root_path:  # the caller gave a bare format: drop the wrapper's "/format"
            path = path.removeprefix("/format")
        raise EvaluatedTagError(path, str(error["msg"])) from None


def _validate_format(content: Any, path: str, original: Any) -> None:
    from pydantic import TypeAdapter, ValidationError
    from xgrammar.structural_tag import Format

    try:
        TypeAdapter(Format).validate_python(content)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise EvaluatedTagError(
            path + _pointer(original, error["loc"]) + _tag_suffix(error), str(error["msg"])
        ) from None


def _tag_suffix(error: Any) -> str:
    """A bad or missing ``type`` is reported on the object; point at its ``type`` field."""
    return "/type" if error.get("type") in ("union_tag_invalid", "union_tag_not_found") else ""


def _pointer(node: Any, loc: Sequence[Any]) -> str:
    """Maps a pydantic error location onto the user's own object (skipping union tags)."""
    parts: list[str] = []
    for item in loc:
        if isinstance(node, Mapping):
            if item in node:
                parts.append(_escape(item))
                node = node[item]
                continue
            if item == node.get("type") or (isinstance(item, str) and "[" in item):
                continue  # the discriminator's tag or a pydantic wrapper, not a field
            parts.append(_escape(item))
            node = None
        elif isinstance(node, list) and isinstance(item, int) and 0 <= item < len(node):
            parts.append(str(item))
            node = node[item]
        else:
            parts.append(_escape(item))
            node = None
    return "".join(f"/{p}" for p in parts)
