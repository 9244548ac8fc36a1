"""The booking study's data and rules, without a model: every message's expected outcome is the
policy applied to its expected facts, the messages are varied as the study asks, the policy
evaluator keeps its contract, and the scorer reads what the study's rules say."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from engine_adapter import literals_in_text
from evald_lab.study.booking.arms import ARMS, arm_schema, extraction_schema, narration_schema
from evald_lab.study.booking.messages import BOOKING_CASES, GROUPS
from evald_lab.study.booking.policy import PolicyEvaluator, apply_policy, evaluate_policy
from evald_lab.study.booking.scoring import consistency_flags, score, validation_schema


def test_every_expected_outcome_is_the_policy_on_the_expected_facts() -> None:
    for case in BOOKING_CASES:
        decision = apply_policy(case.age, case.components)
        assert (decision.action, decision.reason) == (case.action, case.reason), case.case_id
        assert decision.total == case.total, case.case_id


def test_the_messages_are_many_unique_and_cover_what_the_study_asks() -> None:
    assert len(BOOKING_CASES) >= 60
    assert len({c.case_id for c in BOOKING_CASES}) == len(BOOKING_CASES)
    assert len({c.message for c in BOOKING_CASES}) == len(BOOKING_CASES)
    assert {c.group for c in BOOKING_CASES} == set(GROUPS)
    outcomes = Counter(c.action for c in BOOKING_CASES)
    assert all(outcomes[a] >= 8 for a in ("book_appointment", "offer_alternative", "decline"))
    assert outcomes["escalate_human"] >= 8
    totals = {c.total for c in BOOKING_CASES}
    assert {10000, 10001, 12000, 12001} <= totals
    assert {17, 18, 70, 71} <= {c.age for c in BOOKING_CASES}
    # totals that cross a limit only once summed
    crossing = [
        c
        for c in BOOKING_CASES
        if c.total is not None and c.total > 10000 and max(c.components) <= 10000
    ]
    assert len(crossing) >= 12
    worded = [c for c in BOOKING_CASES if c.age is not None and str(c.age) not in c.message]
    assert len(worded) >= 8, "ages written in words"
    assert any("pounds" in c.message for c in BOOKING_CASES)
    assert any("two thousand" in c.message for c in BOOKING_CASES)


def test_every_expected_fact_is_a_literal_of_its_message() -> None:
    """The extracted arm can write every right answer: each expected age and price is one of
    the message's numbers as the literals narrowing reads it (digits, £6,500, words)."""
    for case in BOOKING_CASES:
        held = {float(n) for n in literals_in_text("number", case.message)}
        wanted = ([case.age] if case.age is not None else []) + list(case.components)
        assert {float(n) for n in wanted} <= held, (case.case_id, held)


def test_distractors_are_numbers_the_answer_does_not_use() -> None:
    distracted = [c for c in BOOKING_CASES if c.group == "distractors"]
    for case in distracted:
        numbers = {float(n) for n in literals_in_text("number", case.message)}
        used = {float(case.age)} | {float(p) for p in case.components}
        assert numbers - used, case.case_id


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            '{"age":34,"components":[6500,1200]}',
            {"total": 7700, "action": "book_appointment", "reason": "eligible"},
        ),
        (
            '{"age":46,"components":[6500,4000]}',
            {"total": 10500, "action": "offer_alternative", "reason": "over_limit"},
        ),
        (
            '{"age":15,"components":[14000]}',
            {"total": 14000, "action": "decline", "reason": "under_age"},
        ),
        (
            '{"age":null,"components":[100]}',
            {"total": 100, "action": "escalate_human", "reason": "insufficient_info"},
        ),
        (
            '{"age":40,"components":[]}',
            {"total": None, "action": "escalate_human", "reason": "insufficient_info"},
        ),
    ],
)
def test_the_policy_evaluator_reads_the_facts_object(content: str, expected: object) -> None:
    assert json.loads(evaluate_policy(content)) == expected


@pytest.mark.parametrize(
    "content",
    ["[1, 2]", "not json", '{"age": "old", "components": []}', '{"age": 30, "components": ["a"]}'],
)
def test_the_policy_evaluator_refuses_bad_input_with_syntax(content: str) -> None:
    result = PolicyEvaluator(inner=None).submit("booking_policy", content, 100).result(0)
    assert result.value is None and result.error_code == "syntax" and result.message


def test_the_policy_evaluator_passes_other_names_on() -> None:
    seen = []

    class Inner:
        def submit(self, evaluator: str, content: str, deadline_ms: int) -> str:
            seen.append((evaluator, content, deadline_ms))
            return "future"

    assert PolicyEvaluator(Inner()).submit("calc", "1 + 2", 50) == "future"  # type: ignore[comparison-overlap]
    assert seen == [("calc", "1 + 2", 50)]


def test_the_arms_differ_only_where_they_should() -> None:
    assert set(ARMS) == {"schema-only", "computed", "computed+literals", "two-calls"}
    plain, computed, narrowed = (arm_schema(a) for a in ARMS[:3])
    assert list(plain["properties"]) == [
        "customer_age",
        "price_components",
        "decision",
        "response_text",
    ]
    assert "computed" not in json.dumps(plain)
    assert computed["properties"]["decision"]["computed"] == {
        "by": "booking_policy",
        "from": {"age": "/customer_age", "components": "/price_components"},
    }
    assert narrowed["properties"]["customer_age"]["extracted"] is True
    assert narrowed["properties"]["price_components"]["extracted"] is True
    assert "decision" not in extraction_schema()["properties"]
    assert list(narration_schema()["properties"]) == ["response_text"]


def test_validation_allows_the_error_object_only_in_place_of_a_computed_value() -> None:
    lowered = validation_schema(arm_schema("computed"))
    assert "computed" not in json.dumps(lowered)
    assert lowered["properties"]["decision"]["anyOf"][1]["required"] == ["$error"]
    assert "anyOf" not in validation_schema(arm_schema("schema-only"))["properties"]["decision"]


_CASE = BOOKING_CASES[28]  # 42, 6500 + 4000: offer an alternative


def _doc(decision: object, reply: str = "We can offer a reduced-scope consultation.") -> str:
    return json.dumps(
        {
            "customer_age": 42,
            "price_components": [6500, 4000],
            "decision": decision,
            "response_text": reply,
        }
    )


def test_scoring_a_right_computed_document() -> None:
    verdict = score(
        _CASE,
        "computed",
        [_doc({"total": 10500, "action": "offer_alternative", "reason": "over_limit"})],
    )
    assert verdict["schema_valid"] and verdict["fully_correct"] and verdict["follows_facts"]
    assert verdict["consistent"] and verdict["components_correct"]


def test_scoring_a_wrong_booking_that_ignores_its_own_facts() -> None:
    verdict = score(
        _CASE,
        "schema-only",
        [
            _doc(
                {"total": 10500, "action": "book_appointment", "reason": "eligible"},
                "You're booked for Wednesday at 2pm, see you then!",
            )
        ],
    )
    assert verdict["schema_valid"] and not verdict["decision_correct"]
    assert verdict["follows_facts"] is False
    assert verdict["fields_correct"] == {
        "action": False,
        "reason": False,
        "total": True,
        "age": True,
    }
    assert verdict["consistent"], "a booking reply to a booking decision is consistent"


def test_scoring_the_error_object_and_an_invalid_document() -> None:
    verdict = score(_CASE, "computed", [_doc({"$error": "deadline_exceeded"})])
    assert verdict["schema_valid"] and verdict["decision_error"] == "deadline_exceeded"
    assert not verdict["decision_correct"] and verdict["follows_facts"] is None
    # the schema-only arm has no error alternative
    assert not score(_CASE, "schema-only", [_doc({"$error": "x"})])["schema_valid"]
    assert not score(_CASE, "computed", ['{"customer_age": 42, "price_c'])["schema_valid"]


def test_scoring_two_calls_applies_the_policy_to_the_extraction() -> None:
    texts = [
        '{"customer_age": 42, "price_components": [6500, 4000]}',
        '{"response_text": "Unfortunately we cannot book this, but we can offer less."}',
    ]
    verdict = score(_CASE, "two-calls", texts)
    assert verdict["schema_valid"] and verdict["fully_correct"] and verdict["follows_facts"]
    assert verdict["consistent"]
    wrong = score(
        _CASE, "two-calls", ['{"customer_age": 42, "price_components": [6500]}', texts[1]]
    )
    assert wrong["action"] == "book_appointment" and not wrong["decision_correct"]
    assert wrong["consistency_flags"] == ["book_but_decline_language"]


@pytest.mark.parametrize(
    ("action", "reply", "flags"),
    [
        (
            "decline",
            "You're booked in, see you on Tuesday.",
            ["booking_confirmation", "time_stated_as_agreed"],
        ),
        ("decline", "Sorry, we cannot take this booking: you must be 18 or over.", []),
        (
            "offer_alternative",
            "Your consultation has been confirmed for Monday.",
            ["booking_confirmation"],
        ),
        ("escalate_human", "A colleague will call you to confirm the details.", []),
        ("book_appointment", "Unfortunately we are unable to help.", ["book_but_decline_language"]),
        ("book_appointment", "Great news, we look forward to seeing you on the 21st.", []),
    ],
)
def test_consistency_rules(action: str, reply: str, flags: list[str]) -> None:
    assert consistency_flags(action, reply) == flags


def test_no_case_message_uses_markup_the_grammar_refuses() -> None:
    assert not any(re.search(r"[<>]", c.message) for c in BOOKING_CASES)


def test_the_recorded_decisions_are_the_sdk_policys_on_every_recorded_input() -> None:
    """The committed runs computed the decision with the study's code as an evaluator; the SDK's
    WASM policy answers every input those runs recorded with the same decision, and the engine
    forces a decision canonically (the schema's key order), so a run with the WASM policy forces
    the same tokens."""
    from engine_adapter import InProcessWasmEvaluator
    from evaluators_wasm import example_path

    inputs: dict[str, dict[str, Any]] = {}
    for path in sorted(Path("reports/study/booking").glob("*/records.jsonl")):
        for line in path.read_text().splitlines():
            for computed in json.loads(line)["computed"]:
                inputs[computed["content"]] = json.loads(computed["value"])
    assert len(inputs) >= 100
    with InProcessWasmEvaluator([example_path("booking_policy")], threads=1) as wasm:
        for content, recorded in inputs.items():
            result = wasm.submit("booking_policy", content, 5000).result()
            assert result.error_code is None and json.loads(result.value or "") == recorded, content
