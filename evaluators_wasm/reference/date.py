"""Reference implementation of ``date/1`` (docs/semantics/date.md).

Calendar arithmetic is ``datetime.date`` (proleptic Gregorian, years 1-9999, exactly the
evaluator's range) through ordinals, plus the month rule: move the month, then clamp the day to
the target month's length. Like the WASM guest (``evaluators_wasm/src/date/main.zig``) it reads
the input once, left to right, applying each step as soon as it is read, so both report the same
first error.
"""

from __future__ import annotations

import calendar
import datetime

from evaluators_wasm.reference import GuestError

__all__ = ["MAX_STEPS", "UNITS", "WEEKDAYS", "evaluate"]

MAX_STEPS = 1000
"""``+ N unit`` / ``- N unit`` steps in one input (both date expressions of ``days_between``)."""

WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
UNITS = {
    "day": "days",
    "days": "days",
    "week": "weeks",
    "weeks": "weeks",
    "month": "months",
    "months": "months",
    "year": "years",
    "years": "years",
}
_FUNCTIONS = ("weekday", "day_of_year", "days_between")
_WHITESPACE = b" \t\n\r"
_NAME_SHOWN = 24  # characters of an unknown name quoted in the message
_MAX_ORDINAL = datetime.date.max.toordinal()


def _is_digit(c: int) -> bool:
    return 0x30 <= c <= 0x39


def _is_word(c: int) -> bool:
    return 0x61 <= c <= 0x7A or c == 0x5F  # a-z and _


class _Parser:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.steps = 0

    def peek(self) -> int:
        return self.data[self.pos] if self.pos < len(self.data) else -1

    def skip_ws(self) -> None:
        while self.peek() != -1 and self.peek() in _WHITESPACE:
            self.pos += 1

    def fail(self, what: str) -> GuestError:
        return GuestError("syntax", f"{what} at byte {self.pos}")

    def expect(self, char: str) -> None:
        self.skip_ws()
        if self.peek() != ord(char):
            raise self.fail(f"expected '{char}'")
        self.pos += 1

    def word(self) -> str:
        start = self.pos
        while _is_word(self.peek()):
            self.pos += 1
        return self.data[start : self.pos].decode("ascii")

    def top(self) -> str:
        """``DATE_EXPR`` or ``weekday(…)``, ``day_of_year(…)``, ``days_between(…, …)``."""
        self.skip_ws()
        if not _is_word(self.peek()):
            return self.date_expr().isoformat()
        start = self.pos
        name = self.word()
        if name not in _FUNCTIONS:
            self.pos = start
            raise self.fail(f"unknown function '{name[:_NAME_SHOWN]}'")
        self.expect("(")
        first = self.date_expr()
        if name == "days_between":
            self.expect(",")
            second = self.date_expr()
        self.expect(")")
        if name == "weekday":
            return WEEKDAYS[first.weekday()]
        if name == "day_of_year":
            return str(first.timetuple().tm_yday)
        return str(second.toordinal() - first.toordinal())

    def date_expr(self) -> datetime.date:
        """A date literal followed by any number of ``+ N unit`` / ``- N unit`` steps."""
        value = self.date_literal()
        while True:
            self.skip_ws()
            sign = self.peek()
            if sign not in (ord("+"), ord("-")):
                return value
            self.steps += 1
            if self.steps > MAX_STEPS:
                raise GuestError("too_large", f"more than {MAX_STEPS} steps")
            self.pos += 1
            self.skip_ws()
            amount = self.amount()
            self.skip_ws()
            start = self.pos
            unit = self.word()
            if unit not in UNITS:
                self.pos = start
                raise self.fail("expected a unit (days, weeks, months or years)")
            value = _step(value, amount if sign == ord("+") else -amount, UNITS[unit])

    def date_literal(self) -> datetime.date:
        self.skip_ws()
        start = self.pos
        shape = "dddd-dd-dd"
        for kind in shape:
            c = self.peek()
            if not (_is_digit(c) if kind == "d" else c == ord("-")):
                raise self.fail("expected a date YYYY-MM-DD")
            self.pos += 1
        year, month, day = (int(x) for x in self.data[start : self.pos].split(b"-"))
        if year == 0:
            raise GuestError("domain", "year 0000 is outside 0001-9999")
        if not 1 <= month <= 12:
            raise GuestError("domain", f"month {month:02d} does not exist")
        if not 1 <= day <= calendar.monthrange(year, month)[1]:
            raise GuestError("domain", f"{year:04d}-{month:02d} has no day {day:02d}")
        return datetime.date(year, month, day)

    def amount(self) -> int:
        start = self.pos
        while _is_digit(self.peek()):
            self.pos += 1
        if self.pos == start:
            raise self.fail("expected a number of days, weeks, months or years")
        digits = self.data[start : self.pos].lstrip(b"0")
        # Any amount of ten or more digits overflows whatever the unit; int() is kept small.
        return int(digits) if 0 < len(digits) < 10 else (10**9 if digits else 0)


def _step(value: datetime.date, amount: int, unit: str) -> datetime.date:
    if unit in ("days", "weeks"):
        ordinal = value.toordinal() + amount * (7 if unit == "weeks" else 1)
        if not 1 <= ordinal <= _MAX_ORDINAL:
            raise GuestError("overflow", "result outside 0001-01-01..9999-12-31")
        return datetime.date.fromordinal(ordinal)
    months = value.year * 12 + value.month - 1 + amount * (12 if unit == "years" else 1)
    year, month0 = divmod(months, 12)
    if not 1 <= year <= 9999:
        raise GuestError("overflow", "result outside 0001-01-01..9999-12-31")
    month = month0 + 1
    return datetime.date(year, month, min(value.day, calendar.monthrange(year, month)[1]))


def evaluate(data: bytes) -> str:
    """Evaluates one ``date`` span; raises :class:`GuestError` with the guest's code."""
    for offset, byte in enumerate(data):
        if byte >= 0x80:
            raise GuestError("syntax", f"non-ASCII byte at byte {offset}")
    parser = _Parser(data)
    result = parser.top()
    parser.skip_ws()
    if parser.pos != len(data):
        raise parser.fail("unexpected text after the expression")
    return result
