"""The booking study's arms: the schemas each one sends and the text the model is given.

Every arm's system text begins with the same policy text (:data:`POLICY_TEXT`), then says
what to write and shows one worked example of it; only what the model is asked to write
changes (the shared beginning also stays in the local engine's prompt cache from one request to
the next, whichever arm runs):

- ``schema-only`` (the study's design 1, adapted): the model writes every field,
  ``customer_age``, ``price_components``, the ``decision`` (``total``, ``action``,
  ``reason``) and then ``response_text``.
- ``computed``: the same document, the same prompt; ``decision`` is computed by the
  ``booking_policy`` evaluator from ``{"age": "/customer_age", "components":
  "/price_components"}``, so the model writes the facts, the engine forces the decision, and the
  model writes the reply after it.
- ``computed+literals``: ``computed`` with ``"extracted": true`` on ``customer_age`` and
  ``price_components`` (each narrowed to the numbers of the customer's message).
- ``two-calls`` (the study's pipeline): an extraction request (``customer_age``,
  ``price_components``: no decision field at all), :func:`~.policy.apply_policy` in Python, and
  a second request that writes ``response_text`` given the decision.

Prices are whole pounds (``integer``): every price in the messages is, and a JSON number
grammar would let a small model write ``6500.000…`` until its budget ends.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from evald_lab.study.booking.policy import ACTIONS, POLICY_NAME, REASONS, Decision

__all__ = [
    "ARMS",
    "COMPUTED_ARMS",
    "EXTRACTION_PROMPT",
    "NARRATION_PROMPT",
    "POLICY_TEXT",
    "REPLY_MAX_LENGTH",
    "SINGLE_CALL_PROMPT",
    "TWO_CALLS",
    "arm_schema",
    "extraction_schema",
    "narration_request",
    "narration_schema",
]

SCHEMA_ONLY = "schema-only"
COMPUTED = "computed"
COMPUTED_LITERALS = "computed+literals"
TWO_CALLS = "two-calls"
ARMS = (SCHEMA_ONLY, COMPUTED, COMPUTED_LITERALS, TWO_CALLS)
#: The arms whose decision the engine computes with the policy evaluator.
COMPUTED_ARMS = (COMPUTED, COMPUTED_LITERALS)
#: Longest reply, in characters: a few sentences, and a bound on a small model that rambles.
REPLY_MAX_LENGTH = 200

POLICY_TEXT = (
    "You are the booking assistant of a home-improvement consultancy. The booking policy:\n"
    "- The customer must be aged 18 to 70: under 18, decline (under_age); over 70, decline "
    "(over_age).\n"
    "- The total is the sum of the prices of the services asked for. Up to 10000 pounds: "
    "book_appointment (eligible). 10001 to 12000: offer_alternative, a smaller consultation "
    "(over_limit). Above 12000: decline (over_limit).\n"
    "- The customer's own age or the prices not given: escalate_human (insufficient_info)."
)
#: One worked example, the same in every arm (each arm shows the part it asks for): a
#: 135M-parameter model given a JSON grammar and no example writes dates into every string.
_EXAMPLE_MESSAGE = "I'm 30. The survey is £500 and the design is £1,200. Friday at 9am?"
_EXAMPLE_FACTS = '"customer_age": 30, "price_components": [500, 1200]'
_EXAMPLE_DECISION = '{"action": "book_appointment", "reason": "eligible", "total": 1700}'
_EXAMPLE_REPLY = "Thank you! Your consultation is booked for Friday at 9am."
SINGLE_CALL_PROMPT = (
    f"{POLICY_TEXT}\n\nAnswer with one JSON object: customer_age (the customer's own age, "
    "null if not given), price_components (each price in pounds), decision (action, reason, "
    "total) and response_text (a short reply to the customer).\n"
    f"Example: {_EXAMPLE_MESSAGE}\n"
    f'{{{_EXAMPLE_FACTS}, "decision": {_EXAMPLE_DECISION}, "response_text": "{_EXAMPLE_REPLY}"}}'
)
EXTRACTION_PROMPT = (
    f"{POLICY_TEXT}\n\nFirst step, the facts only. Answer with one JSON object: customer_age "
    "(the customer's own age, null if not given) and price_components (each price in pounds, "
    "empty if none is given).\n"
    f"Example: {_EXAMPLE_MESSAGE}\n{{{_EXAMPLE_FACTS}}}"
)
NARRATION_PROMPT = (
    f"{POLICY_TEXT}\n\nThe booking system has decided. Write a short reply to the customer "
    "that tells them the decision. Answer with one JSON object: response_text.\n"
    f"Example: Customer message: {_EXAMPLE_MESSAGE}\nDecision: {_EXAMPLE_DECISION}\n"
    f'{{"response_text": "{_EXAMPLE_REPLY}"}}'
)

_AGE: dict[str, Any] = {"anyOf": [{"type": "integer"}, {"type": "null"}]}
_COMPONENTS: dict[str, Any] = {"type": "array", "items": {"type": "integer"}, "maxItems": 6}
_DECISION: dict[str, Any] = {
    "type": "object",
    "properties": {
        "action": {"type": "string", "enum": list(ACTIONS)},
        "reason": {"type": "string", "enum": list(REASONS)},
        "total": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["action", "reason", "total"],
    "additionalProperties": False,
}
_REPLY: dict[str, Any] = {"type": "string", "maxLength": REPLY_MAX_LENGTH}


def _document(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def arm_schema(arm: str) -> dict[str, Any]:
    """The JSON schema a single-call arm sends (``two-calls`` sends :func:`extraction_schema`
    and :func:`narration_schema`).

    Raises:
        ValueError: an unknown arm, or ``two-calls``.
    """
    if arm not in (SCHEMA_ONLY, *COMPUTED_ARMS):
        raise ValueError(f"{arm!r} is not a single-call arm; choose from {ARMS[:3]}")
    age, components, decision = copy.deepcopy((_AGE, _COMPONENTS, _DECISION))
    if arm in COMPUTED_ARMS:
        decision["computed"] = {
            "by": POLICY_NAME,
            "from": {"age": "/customer_age", "components": "/price_components"},
        }
    if arm == COMPUTED_LITERALS:
        age["extracted"] = True
        components["extracted"] = True
    return _document(
        {
            "customer_age": age,
            "price_components": components,
            "decision": decision,
            "response_text": dict(_REPLY),
        }
    )


def extraction_schema() -> dict[str, Any]:
    """The first request of ``two-calls``: the facts, no decision field."""
    return _document(copy.deepcopy({"customer_age": _AGE, "price_components": _COMPONENTS}))


def narration_schema() -> dict[str, Any]:
    """The second request of ``two-calls``: the reply alone."""
    return _document({"response_text": dict(_REPLY)})


def narration_request(message: str, decision: Decision) -> str:
    """The second request's user text: the customer's message and the policy's decision."""
    return (
        f"Customer message: {message}\n"
        f"Decision: {json.dumps(decision.as_json(), separators=(', ', ': '))}"
    )
