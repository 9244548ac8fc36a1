"""Which spans of a request's structural tag are evaluated, in either of their two spellings.

A request names evaluated spans in one of two ways, and may mix them:

- ``evaluated_tag`` elements (the request format, ``engine_adapter.spans._evaluated_tag``). They are
  lowered here, on the server, with the evaluators the tenant may call (``ListEvaluators``). The
  raw ``/generate`` API and the offline ``sglang.Engine`` pass structural tags through untouched,
  so these work there.
- The **lowered form** that :func:`engine_adapter.build_structural_tag` and
  :func:`engine_adapter.lower_evaluated_tags` emit: a plain XGrammar ``tag`` whose ``end`` is
  empty and whose content is ``[content, const_string(END), or[value tag, error tag]]``, the error
  tag's content being the regex :data:`engine_adapter.ERROR_CODE_REGEX`. SGLang's OpenAI-compatible
  API validates ``response_format`` against XGrammar's own schema (an ``evaluated_tag`` is refused
  with HTTP 400) and re-serialises it, so that API can only carry this form; it is
  self-describing, so no side channel is needed. The evaluator is the one whose tag opens the
  span (``<calc>`` → the evaluator with tag ``calc``), else the one whose input grammar is the
  span's content, else the opener's inner text (evald then answers ``unknown_evaluator`` in band).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine_adapter.spans._evaluated_tag import (
    EvaluatedTagError,
    contains_evaluated_tag,
    lower_evaluated_tags,
)
from engine_adapter.spans._grammar import ERROR_CODE_REGEX, EvaluatorSpec, check_bindings
from engine_adapter.spans._types import SpanBinding

__all__ = ["EvaluatorsUnavailable", "SpanPlan", "find_lowered_spans", "plan_spans"]

_TAG_NAME = re.compile(r"<([A-Za-z_][A-Za-z0-9_.:-]*)>")


class EvaluatorsUnavailable(Exception):
    """``ListEvaluators`` could not be answered; the message says why."""


@dataclass(frozen=True)
class SpanPlan:
    """What to compile for a request, and the spans its injector must follow."""

    key_string: str
    """The structural tag to compile (lowered when the request held ``evaluated_tag``s)."""
    bindings: tuple[SpanBinding, ...]


def plan_spans(
    key_string: str,
    evaluators: Callable[[bool], Sequence[EvaluatorSpec]],
) -> SpanPlan | None:
    """The plan for one ``structural_tag`` request key, or ``None`` when nothing is evaluated.

    Parameters:
        key_string: the request's ``structural_tag`` as SGLang holds it (JSON text).
        evaluators: returns the tenant's evaluators; called only when needed, with ``True`` to
            ask for a fresh answer (after an unknown evaluator name). Raises
            :class:`EvaluatorsUnavailable` when evald cannot answer.

    Raises:
        EvaluatedTagError: an invalid ``evaluated_tag`` (the message names the field), or one
            that cannot be lowered because evald is unreachable.
    """
    try:
        tag = json.loads(key_string)
    except ValueError:
        return None  # SGLang's own compile step reports the bad JSON
    if not isinstance(tag, Mapping) or "structures" in tag:
        return None  # legacy structural tags carry JSON schemas only
    bindings: tuple[SpanBinding, ...] = ()
    lowered: Mapping[str, Any] = tag
    specs: Sequence[EvaluatorSpec] | None = None
    if contains_evaluated_tag(tag):
        specs = _fetch(evaluators, refresh=False)
        try:
            grammar = lower_evaluated_tags(tag, specs)
        except EvaluatedTagError as exc:
            if "unknown evaluator" not in exc.message:
                raise
            specs = _fetch(evaluators, refresh=True)  # maybe registered since the last answer
            grammar = lower_evaluated_tags(tag, specs)
        assert grammar.structural_tag is not None
        lowered = grammar.structural_tag
        bindings = grammar.bindings
    found = find_lowered_spans(lowered, None)
    known = {b.begin for b in bindings}
    extra = [b for b in found if b.begin not in known]
    if extra:
        if specs is None:
            try:
                specs = evaluators(False)
            except EvaluatorsUnavailable:
                specs = ()  # evaluations will answer `unavailable` in band anyway
        extra = list(find_lowered_spans(lowered, specs, skip=known))
    if not bindings and not extra:
        return None
    everything = (*bindings, *extra)
    try:
        check_bindings(everything)
    except ValueError as exc:
        raise EvaluatedTagError("/format", str(exc)) from None
    text = key_string if lowered is tag else json.dumps(lowered, ensure_ascii=False)
    return SpanPlan(text, everything)


def find_lowered_spans(
    tag: Any,
    evaluators: Sequence[EvaluatorSpec] | None,
    *,
    skip: set[str] | frozenset[str] = frozenset(),
) -> tuple[SpanBinding, ...]:
    """Every evaluated span in the lowered form inside a structural tag, one binding per opener,
    in document order.

    Parameters:
        tag: the structural tag (or any format inside one) as parsed JSON.
        evaluators: to name each span's evaluator; ``None`` or empty names it by its opener.
        skip: openers already bound (by lowering) and left out of the answer.

    Raises:
        EvaluatedTagError: one opener used with two different span settings.
    """
    found: dict[str, SpanBinding] = {}
    stack: list[tuple[Any, str]] = [(tag, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{path}/{i}") for i, item in reversed(list(enumerate(node))))
            continue
        if not isinstance(node, Mapping):
            continue
        binding = _lowered_span(node, evaluators or ())
        if binding is not None and binding.begin not in skip:
            known = found.get(binding.begin)
            if known is not None and known != binding:
                raise EvaluatedTagError(
                    f"{path}/begin", f"{binding.begin!r} is used by two differently shaped spans"
                )
            found[binding.begin] = binding
        stack.extend((value, f"{path}/{key}") for key, value in reversed(list(node.items())))
    return tuple(found.values())


def _fetch(
    evaluators: Callable[[bool], Sequence[EvaluatorSpec]], *, refresh: bool
) -> Sequence[EvaluatorSpec]:
    try:
        return evaluators(refresh)
    except EvaluatorsUnavailable as exc:
        raise EvaluatedTagError("/", f"cannot resolve evaluated_tag evaluators: {exc}") from None


def _lowered_span(
    node: Mapping[str, Any], evaluators: Sequence[EvaluatorSpec]
) -> SpanBinding | None:
    """The binding of a node in the shape of ``engine_adapter.spans.span_format``, else None."""
    if node.get("type") != "tag" or node.get("end") != "":
        return None
    begin, content = node.get("begin"), node.get("content")
    if not isinstance(begin, str) or not begin or not isinstance(content, Mapping):
        return None
    elements = content.get("elements")
    if content.get("type") != "sequence" or not isinstance(elements, list) or len(elements) != 3:
        return None
    inner, close, region = elements
    if not isinstance(close, Mapping) or close.get("type") != "const_string":
        return None
    end = close.get("value")
    if not isinstance(end, str) or not end:
        return None
    if not isinstance(region, Mapping) or region.get("type") != "or":
        return None
    options = region.get("elements")
    if not isinstance(options, list) or len(options) != 2:
        return None
    value, error = (_regex_tag(option) for option in options)
    if value is None or error is None or error[1] != ERROR_CODE_REGEX:
        return None
    return SpanBinding(
        evaluator=_evaluator_name(begin, inner, evaluators),
        begin=begin,
        end=end,
        result_begin=value[0],
        result_end=value[2],
        error_begin=error[0],
        error_end=error[2],
        result_regex=value[1],
    )


def _regex_tag(node: Any) -> tuple[str, str, str] | None:
    """``(begin, pattern, end)`` of ``tag(begin, regex(pattern), end)`` with non-empty strings."""
    if not isinstance(node, Mapping) or node.get("type") != "tag":
        return None
    content = node.get("content")
    if not isinstance(content, Mapping) or content.get("type") != "regex":
        return None
    parts = (node.get("begin"), content.get("pattern"), node.get("end"))
    if not all(isinstance(p, str) and p for p in parts):
        return None
    return parts  # type: ignore[return-value]


def _evaluator_name(begin: str, inner: Any, evaluators: Sequence[EvaluatorSpec]) -> str:
    for spec in evaluators:
        if begin == f"<{spec.tag}>":
            return spec.name
    if isinstance(inner, Mapping) and inner.get("type") == "grammar":
        for spec in evaluators:
            if inner.get("grammar") == spec.input_grammar:
                return spec.name
    match = _TAG_NAME.fullmatch(begin)
    return match.group(1) if match else begin
