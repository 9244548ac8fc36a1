"""Rule-based scoring of the booking study (no model judges anything), as the original study:

- **schema-valid**: the text parses as JSON and validates (``jsonschema``) against the schema
  the request sent, where a computed property may also hold the documented error object
  ``{"$error": "CODE"}`` (docs/computed-fields.md); ``two-calls`` needs both of its documents
  valid.
- **decision correct**: the action is the expected one.
- **fully correct**: all four decision fields are right: action, reason, total and the
  customer's age.
- **follows its facts**: the decision equals :func:`~.policy.apply_policy` applied to the age
  and price components the model wrote in the same document (the computed arms must reach
  100 %; the schema-only arm shows how often a model's own decision ignores its own facts).
- **consistent**: the reply agrees with the decision, by the study's regex rules:
  booking-confirmation language or a time stated as agreed when the action is not a booking,
  decline language when it is.
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from evald_lab.study.booking.arms import (
    TWO_CALLS,
    arm_schema,
    extraction_schema,
    narration_schema,
)
from evald_lab.study.booking.messages import BookingCase
from evald_lab.study.booking.policy import apply_policy

__all__ = [
    "ERROR_ALTERNATIVE",
    "consistency_flags",
    "score",
    "validation_schema",
]

#: What a computed property may hold instead of its value: ``{"$error": "CODE"}``.
ERROR_ALTERNATIVE: dict[str, Any] = {
    "type": "object",
    "properties": {"$error": {"type": "string"}},
    "required": ["$error"],
    "additionalProperties": False,
}
_EXTENSIONS = ("computed", "extracted")

_BOOKING_CONFIRM = re.compile(
    r"\b(?:you(?:'re| are) (?:all )?(?:booked|confirmed|scheduled)"
    r"|(?:i|we)(?:'ve| have) (?:booked|scheduled|reserved|confirmed)"
    r"|(?:booked|scheduled) you"
    r"|see you (?:on|at|then|soon)"
    r"|confirmed for"
    r"|(?:appointment|booking|consultation|visit) (?:is|has been) (?:confirmed|booked|scheduled)"
    r"|look(?:ing)? forward to (?:seeing|meeting) you)\b",
    re.IGNORECASE,
)
_DECLINE_LANGUAGE = re.compile(
    r"\b(?:unfortunately|unable to|can(?:no|')t|cannot|not able to|regret|decline[ds]?"
    r"|not eligible|ineligible|no longer eligible)\b",
    re.IGNORECASE,
)
_TIME_AS_AGREED = re.compile(
    r"\b(?:booked|confirmed|scheduled|reserved|see you)\b[^.!?]{0,40}?"
    r"\b(?:at \d{1,2}(?::\d\d)?\s*(?:am|pm)?|on (?:mon|tues|wednes|thurs|fri|satur|sun)day"
    r"|on the \d{1,2}(?:st|nd|rd|th)?|on \d{1,2} [a-z]+)",
    re.IGNORECASE,
)


def validation_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The request's schema as a validator reads the engine's output: each computed property
    may also be :data:`ERROR_ALTERNATIVE`, and the extension keywords are dropped."""
    out = copy.deepcopy(schema)

    def visit(node: Any) -> Any:
        if isinstance(node, list):
            return [visit(child) for child in node]
        if not isinstance(node, dict):
            return node
        computed = "computed" in node
        node = {k: visit(v) for k, v in node.items() if k not in _EXTENSIONS}
        if isinstance(node.get("properties"), dict):
            node["properties"] = {k: visit(v) for k, v in node["properties"].items()}
        return {"anyOf": [node, ERROR_ALTERNATIVE]} if computed else node

    result: dict[str, Any] = visit(out)
    return result


def _parse_valid(text: str, schema: dict[str, Any]) -> tuple[Any, bool]:
    """``(document or None, schema-valid)``."""
    import jsonschema

    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return None, False
    try:
        jsonschema.validate(document, validation_schema(schema))
    except jsonschema.ValidationError:
        return document, False
    return document, True


def consistency_flags(action: str | None, reply: str | None) -> list[str]:
    """The study's rules: what in the reply contradicts the decision (empty: consistent)."""
    if action is None or reply is None:
        return []
    flags = []
    if action == "book_appointment":
        if _DECLINE_LANGUAGE.search(reply):
            flags.append("book_but_decline_language")
    else:
        if _BOOKING_CONFIRM.search(reply):
            flags.append("booking_confirmation")
        if _TIME_AS_AGREED.search(reply):
            flags.append("time_stated_as_agreed")
    return flags


def _field(document: Any, key: str) -> Any:
    return document.get(key) if isinstance(document, dict) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _facts(document: Any) -> tuple[Any, list[Any] | None]:
    age = _field(document, "customer_age")
    components = _field(document, "price_components")
    return age, components if isinstance(components, list) else None


def score(case: BookingCase, arm: str, texts: Sequence[str]) -> dict[str, Any]:
    """The verdict of one (case, arm) from its generated text(s): one text for a single-call
    arm, the extraction's and the narration's for ``two-calls``."""
    if arm == TWO_CALLS:
        facts_doc, facts_valid = _parse_valid(texts[0], extraction_schema())
        reply_doc, reply_valid = (
            _parse_valid(texts[1], narration_schema()) if len(texts) > 1 else (None, False)
        )
        age, components = _facts(facts_doc)
        decision: Any = apply_policy(_number(age), _numbers(components)).as_json()
        valid = facts_valid and reply_valid
        reply = _field(reply_doc, "response_text")
    else:
        document, valid = _parse_valid(texts[0], arm_schema(arm))
        age, components = _facts(document)
        decision = _field(document, "decision")
        reply = _field(document, "response_text")
    return _verdict(case, valid, age, components, decision, reply)


def _numbers(components: list[Any] | None) -> list[float] | None:
    if components is None:
        return None
    numbers = [_number(c) for c in components]
    return None if any(n is None for n in numbers) else [n for n in numbers if n is not None]


def _verdict(
    case: BookingCase,
    valid: bool,
    age: Any,
    components: list[Any] | None,
    decision: Any,
    reply: Any,
) -> dict[str, Any]:
    error = _field(decision, "$error")
    action, reason, total = (_field(decision, k) for k in ("action", "reason", "total"))
    follows = None
    numbers = _numbers(components)
    if isinstance(decision, dict) and error is None:
        own = apply_policy(_number(age), numbers)
        follows = (action, reason, _same_total(total, own.total)) == (own.action, own.reason, True)
    age_ok = _number(age) == _number(case.age) if case.age is not None else age is None
    total_ok = _same_total(total, case.total)
    fields_ok = {
        "action": action == case.action,
        "reason": reason == case.reason,
        "total": total_ok,
        "age": bool(age_ok),
    }
    flags = consistency_flags(
        action if isinstance(action, str) else None, reply if isinstance(reply, str) else None
    )
    return {
        "schema_valid": valid,
        "age": age,
        "components": components,
        "total": total,
        "action": action,
        "reason": reason,
        "decision_error": error,
        "reply": reply if isinstance(reply, str) else None,
        "decision_correct": fields_ok["action"],
        "fully_correct": all(fields_ok.values()),
        "fields_correct": fields_ok,
        "components_correct": numbers is not None
        and Counter(numbers) == Counter(float(c) for c in case.components),
        "follows_facts": follows,
        "consistent": isinstance(reply, str) and isinstance(action, str) and not flags,
        "consistency_flags": flags,
    }


def _same_total(total: Any, expected: int | float | None) -> bool:
    if expected is None:
        return total is None
    value = _number(total)
    return value is not None and abs(value - float(expected)) < 0.005
