"""Recognising evaluated spans in a request's structural tag: ``evaluated_tag`` elements, their
lowered form (what the OpenAI-compatible API can carry), both, or neither. No SGLang needed."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import pytest

from engine_adapter import (
    EvaluatedTagError,
    EvaluatorSpec,
    build_structural_tag,
    lower_evaluated_tags,
    standard_evaluators,
)
from engine_adapter.spans._lowered_spans import (
    EvaluatorsUnavailable,
    find_lowered_spans,
    plan_spans,
)

SPECS = standard_evaluators()


def answer(
    specs: Sequence[EvaluatorSpec] = SPECS, calls: list[bool] | None = None
) -> Callable[[bool], Sequence[EvaluatorSpec]]:
    def evaluators(refresh: bool) -> Sequence[EvaluatorSpec]:
        if calls is not None:
            calls.append(refresh)
        return specs

    return evaluators


def unavailable(refresh: bool) -> Sequence[EvaluatorSpec]:
    raise EvaluatorsUnavailable("ListEvaluators at unix:/nowhere failed: unreachable")


def evaluated_tag(evaluator: str = "calc", **extra: object) -> dict[str, object]:
    return {
        "type": "evaluated_tag",
        "begin": "<calc>",
        "end": "</calc>",
        "evaluator": evaluator,
        "result": {"begin": "<result>", "end": "</result>"},
        **extra,
    }


def test_helper_output_is_recognised_with_the_manifest_bindings() -> None:
    grammar = build_structural_tag(SPECS, "grammar-eval", prefix="So <calc>")
    plan = plan_spans(grammar.json(), answer())
    assert plan is not None
    assert set(plan.bindings) == set(grammar.bindings)
    assert plan.key_string == grammar.json(), "a lowered tag is compiled as sent"


def test_lowered_spans_survive_the_openai_schema_round_trip() -> None:
    from xgrammar.structural_tag import StructuralTag

    grammar = build_structural_tag(SPECS[:2], "grammar-eval")
    dumped = StructuralTag.model_validate(grammar.structural_tag).model_dump(by_alias=True)
    plan = plan_spans(json.dumps(dumped), answer())
    assert plan is not None and set(plan.bindings) == set(grammar.bindings)


def test_evaluated_tag_is_lowered_on_the_server() -> None:
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [{"type": "const_string", "value": "Total: "}, evaluated_tag()],
        },
    }
    calls: list[bool] = []
    plan = plan_spans(json.dumps(tag), answer(calls=calls))
    assert plan is not None
    lowered = lower_evaluated_tags(tag, SPECS)
    assert plan.bindings == lowered.bindings
    assert json.loads(plan.key_string) == lowered.structural_tag
    assert "evaluated_tag" not in plan.key_string
    assert calls == [False]


def test_custom_opener_keeps_its_evaluator_through_lowering() -> None:
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "evaluated_tag",
            "begin": "[[",
            "end": "]]",
            "evaluator": "calc",
            "result": {"begin": "=>", "end": ";"},
            "error": {"begin": "=!", "end": ";"},
        },
    }
    plan = plan_spans(json.dumps(tag), answer())
    assert plan is not None
    (binding,) = plan.bindings
    assert (binding.evaluator, binding.begin, binding.result_begin) == ("calc", "[[", "=>")


def test_lowered_spans_without_evald_are_named_by_their_opener() -> None:
    grammar = build_structural_tag(SPECS[:1], "grammar-eval")
    plan = plan_spans(grammar.json(), unavailable)
    assert plan is not None and plan.bindings[0].evaluator == SPECS[0].tag


def test_evaluated_tag_without_evald_is_a_clear_error() -> None:
    tag = {"type": "structural_tag", "format": evaluated_tag()}
    with pytest.raises(EvaluatedTagError, match=r"cannot resolve evaluated_tag .*unreachable"):
        plan_spans(json.dumps(tag), unavailable)


def test_unknown_evaluator_asks_evald_again_then_names_the_field() -> None:
    calls: list[bool] = []
    tag = {"type": "structural_tag", "format": evaluated_tag("nope")}
    with pytest.raises(EvaluatedTagError) as caught:
        plan_spans(json.dumps(tag), answer(calls=calls))
    assert caught.value.path == "/format/evaluator" and "nope" in caught.value.message
    assert calls == [False, True], "a fresh ListEvaluators is asked for before refusing"


@pytest.mark.parametrize(
    "tag",
    [
        {"type": "structural_tag", "format": {"type": "any_text"}},
        {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {}}},
        {"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<f>"]},
        build_structural_tag(SPECS[:1], "grammar-no-eval").structural_tag,
    ],
    ids=["any_text", "json", "legacy", "grammar-no-eval"],
)
def test_tags_without_evaluated_spans_are_left_alone(tag: object) -> None:
    assert plan_spans(json.dumps(tag), unavailable) is None


def test_bad_json_is_left_for_sglang_to_report() -> None:
    assert plan_spans("{not json", unavailable) is None


def test_one_opener_with_two_shapes_is_refused() -> None:
    a = build_structural_tag(SPECS[:1], "grammar-eval").structural_tag
    b = json.loads(json.dumps(a).replace("</result>", "</value>"))
    both = {"type": "or", "elements": [a["format"], b["format"]]}
    tag = {"type": "structural_tag", "format": both}
    with pytest.raises(EvaluatedTagError, match="two differently shaped spans"):
        find_lowered_spans(tag, SPECS)
