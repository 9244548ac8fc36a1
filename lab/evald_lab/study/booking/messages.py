"""The booking study's customer messages, written by hand, each with its known outcome
(``messages.json`` beside this module: data, not code).

Every message asks a home-improvement consultancy for a consultation; the expected facts are
the customer's **own** age (``None`` when the message does not give it) and the prices of the
requested services in pounds (empty when it gives none); the expected decision is
:func:`evald_lab.study.booking.policy.apply_policy` of those facts, written out by hand in
the file and checked against the policy by the tests.

The messages vary on purpose (no template): ages in digits and in words (``forty-six``);
distractor numbers (a child's or parent's age, a house number, a phone number, dates, times,
years, counts, a budget); prices as ``£6,500``, ``1200 pounds`` and ``two thousand``; totals
that cross £10,000 or £12,000 only once the components are summed; the boundary totals
(exactly 10,000, 10,001, 12,000, 12,001); the boundary ages 17, 18, 70 and 71; an age check
that decides before an over-limit total; and messages without an age, without prices, or
without both (escalated to a person).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

__all__ = ["BOOKING_CASES", "GROUPS", "BookingCase"]

#: The groups, in the order the tables list them.
GROUPS = (
    "plain",
    "age_in_words",
    "distractors",
    "crosses_after_sum",
    "boundary_total",
    "boundary_age",
    "age_decides",
    "missing_age",
    "missing_prices",
)


@dataclass(frozen=True)
class BookingCase:
    """One customer message and its known outcome."""

    case_id: int
    group: str
    message: str
    age: int | None
    """The customer's own age; ``None`` when the message does not give it."""
    components: tuple[int, ...]
    """The prices of the requested services, in pounds, in the message's order."""
    when: str | None
    """The requested date and/or time as written, ``None`` when none is asked for."""
    action: str
    reason: str

    @property
    def total(self) -> int | None:
        """The sum of the components; ``None`` without any (the policy cannot decide)."""
        return sum(self.components) if self.components else None


def _load() -> tuple[BookingCase, ...]:
    """The cases of ``messages.json`` (one object per case: ``id``, ``group``, ``message``,
    ``age``, ``components``, ``when``, ``action``, ``reason``)."""
    raw = json.loads(resources.files(__package__).joinpath("messages.json").read_text("utf-8"))
    return tuple(
        BookingCase(
            case_id=int(entry["id"]),
            group=str(entry["group"]),
            message=str(entry["message"]),
            age=entry["age"],
            components=tuple(int(price) for price in entry["components"]),
            when=entry["when"],
            action=str(entry["action"]),
            reason=str(entry["reason"]),
        )
        for entry in raw
    )


#: Every case, in the file's order (the run order).
BOOKING_CASES: tuple[BookingCase, ...] = _load()
