"""Computed properties: what a schema may say, and every refusal with its JSON pointer."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

xgr = pytest.importorskip("xgrammar")

from engine_adapter.spans import (  # noqa: E402
    ComputedSchemaError,
    ValueCheck,
    contains_computed,
    lower_computed_schema,
    standard_evaluators,
)


def obj(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


def calc(source: Any = "/expression", kind: str = "number") -> dict[str, Any]:
    return {"type": kind, "computed": {"by": "calc", "from": source}}


POLICY_RESULT = {
    "type": "object",
    "properties": {
        "total": {"type": ["number", "null"]},
        "action": {"enum": ["book_appointment", "offer_alternative", "decline", "escalate_human"]},
        "reason": {"type": "string"},
    },
    "required": ["total", "action", "reason"],
}


def policy_evaluators() -> list[Any]:
    calc_spec = next(s for s in standard_evaluators() if s.name == "calc")
    policy = replace(
        calc_spec,
        name="booking_policy",
        tag="booking_policy",
        input_schema={
            "type": "object",
            "properties": {"age": {}, "components": {}},
            "required": ["age", "components"],
            "additionalProperties": False,
        },
        result_schema=POLICY_RESULT,
    )
    return [*standard_evaluators(), policy]


def refused(schema: Any, evaluators: list[Any] | None = None) -> ComputedSchemaError:
    with pytest.raises(ComputedSchemaError) as caught:
        lower_computed_schema(schema, evaluators or standard_evaluators())
    return caught.value


def test_the_essays_example_and_a_policy_object_read_naturally() -> None:
    essay = obj(expression={"type": "string"}, answer=calc())
    plan = lower_computed_schema(essay, standard_evaluators()).computed
    assert plan is not None
    (field,) = plan.fields
    assert (field.pointer, field.evaluator, field.form, field.delimiter) == (
        "/answer",
        "calc",
        "value",
        "}",
    )
    booking = obj(
        customer_age={"type": ["integer", "null"]},
        price_components={"type": "array", "items": {"type": "number"}},
        decision={
            **POLICY_RESULT,
            "computed": {
                "by": "booking_policy",
                "from": {"age": "/customer_age", "components": "/price_components"},
            },
        },
        reply={"type": "string"},
    )
    plan = lower_computed_schema(booking, policy_evaluators()).computed
    assert plan is not None
    (field,) = plan.fields
    assert field.form == "object" and field.delimiter == ""  # an object ends itself
    assert field.sources == (("age", ("customer_age",)), ("components", ("price_components",)))
    assert contains_computed(booking) and not contains_computed(obj(a={"type": "string"}))


@pytest.mark.parametrize(
    ("schema", "path", "words"),
    [
        (obj(answer=calc(), expression={"type": "string"}), "/properties/answer/computed/from",
         "comes after /answer"),
        (obj(expression={"type": "string"}, answer={"type": "number", "computed": {
            "by": "calx", "from": "/expression"}}), "/properties/answer/computed/by",
         "unknown evaluator 'calx'"),
        (obj(expression={"type": "string"}, answer=calc("/nope")),
         "/properties/answer/computed/from", "points to nothing"),
        (obj(expression={"type": "string"}, answer=calc("/expression/deeper")),
         "/properties/answer/computed/from", "points to nothing"),
        (obj(a=calc("/b", "string"), b=calc("/a", "string")), "/properties/b/computed/from",
         "circular"),
        (obj(answer=calc("/answer")), "/properties/answer/computed/from", "itself"),
        (obj(expression={"type": "string"}, answer=calc("expression")),
         "/properties/answer/computed/from", "starts with '/'"),
        (obj(expression={"type": "string"}, answer={"type": "number", "computed": {
            "by": "calc"}}), "/properties/answer/computed/from", "missing"),
        (obj(expression={"type": "string"}, answer={"type": "number", "computed": {
            "by": "calc", "from": "/expression", "to": 1}}), "/properties/answer/computed/to",
         "unknown field"),
        (obj(xs={"type": "array", "items": obj(e={"type": "string"}, v=calc("/xs"))}),
         "/properties/xs/items/properties/v/computed", "through 'properties' only"),
        (obj(u={"anyOf": [obj(e={"type": "string"}, v=calc("/u"))]}),
         "/properties/u/anyOf/0/properties/v/computed", "through 'properties' only"),
        (obj(e={"type": "string"}, v=calc("/e"), tail={"type": "string"}), "/properties/v",
         "append digits"),
        ({**obj(e={"type": "string"}, v=calc("/e")), "additionalProperties": True},
         "/additionalProperties", "must not allow other properties"),
        ({"type": "array", "items": {}}, "/type", "root must be an object"),
        (obj(e={"type": "string"}, v={**obj(w=calc("/e")), "computed": {
            "by": "calc", "from": "/e"}}), "/properties/v/properties/w/computed",
         "cannot hold another"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(schema: Any, path: str, words: str) -> None:
    error = refused(schema)
    assert error.path == path, str(error)
    assert words in error.message, str(error)


def test_a_declared_schema_that_cannot_hold_the_evaluators_result_is_refused() -> None:
    schema = obj(
        age={"type": "integer"},
        parts={"type": "array"},
        decision={
            "type": "object",
            "properties": {"action": {"enum": ["book_appointment", "decline"]}},
            "computed": {"by": "booking_policy", "from": {"age": "/age", "components": "/parts"}},
        },
    )
    error = refused(schema, policy_evaluators())
    assert error.path == "/properties/decision/computed/by"
    assert "booking_policy" in error.message


def test_an_input_the_policy_does_not_take_is_refused() -> None:
    schema = obj(
        age={"type": "integer"},
        decision={**POLICY_RESULT, "computed": {"by": "booking_policy", "from": {"years": "/age"}}},
    )
    error = refused(schema, policy_evaluators())
    assert error.path == "/properties/decision/computed/from/years"
    assert "takes no input 'years'" in error.message


def test_json_text_and_a_bad_json_text() -> None:
    essay = obj(expression={"type": "string"}, answer=calc())
    assert lower_computed_schema(json.dumps(essay), standard_evaluators()).computed is not None
    assert refused("{not json").path == "/"


def test_value_check_reads_json_then_text_and_orders_keys() -> None:
    check = ValueCheck(POLICY_RESULT)
    text, why = check.render(
        '{"reason": "eligible", "action": "book_appointment", "total": 7700.0}'
    )
    assert (text, why) == (
        '{"total": 7700, "action": "book_appointment", "reason": "eligible"}',
        "",
    )
    text, why = check.render('{"total": 1, "action": "fly", "reason": "x"}')
    assert text is None and "does not fit" in why
    date = ValueCheck({"type": "string"})
    assert date.render("2024-07-04") == ('"2024-07-04"', "")
    assert ValueCheck({"type": "integer", "maximum": 10}).render("11")[0] is None
    assert ValueCheck({"type": "string", "enum": ["a"]}).render("a") == ('"a"', "")


def test_an_input_the_policy_bounds_must_be_bounded_as_tightly_in_the_schema() -> None:
    evaluators = policy_evaluators()
    policy = evaluators[-1]
    bounded = replace(
        policy,
        input_schema={
            "type": "object",
            "properties": {"age": {}, "components": {"type": "array", "maxItems": 10}},
        },
    )
    evaluators[-1] = bounded

    def schema(parts: dict[str, Any]) -> dict[str, Any]:
        return obj(
            age={"type": "integer"},
            parts=parts,
            decision={
                **POLICY_RESULT,
                "computed": {
                    "by": "booking_policy",
                    "from": {"age": "/age", "components": "/parts"},
                },
            },
        )

    error = refused(schema({"type": "array", "items": {"type": "number"}}), evaluators)
    assert error.path == "/properties/decision/computed/from/components"
    assert "maxItems 10" in error.message and "no maxItems" in error.message
    lowered = lower_computed_schema(
        schema({"type": "array", "items": {"type": "number"}, "maxItems": 10}), evaluators
    )
    assert lowered.computed is not None
