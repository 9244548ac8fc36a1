"""date/1: the WASM guest against its conformance cases, its Python reference and its bombs.

As for strop, the differential tests compare the whole outcome, message included: guest and
reference read the input with the same single left-to-right pass.
"""

from __future__ import annotations

import calendar
import datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evaluators_wasm.reference import date as ref
from tests.evaluators_wasm.support import (
    MIB,
    PROPERTY_TIMEOUT,
    DefaultLimitsGuest,
    Evaluator,
    Guest,
    mutated,
    property_settings,
)

DATE = Evaluator("date", {"syntax", "overflow", "domain", "too_large"})
PROPERTY = property_settings()


# --- conformance ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", DATE.cases, ids=lambda c: repr(DATE.data(c)[:60]))
def test_conformance(guest: Guest, case: dict[str, Any]) -> None:
    DATE.check_case(guest, case)


def test_conformance_covers_every_operation_and_error() -> None:
    for word in ("days", "week", "month", "year", "days_between(", "weekday(", "day_of_year("):
        assert word in DATE.conformance_text
    assert {"syntax", "overflow", "domain"} <= DATE.case_codes()


# --- differential (hypothesis) --------------------------------------------------------------

_WS = st.sampled_from(["", "", " ", " ", "  ", "\n", "\t "])
_EDGE_DATES = [datetime.date(1, 1, 1), datetime.date(9999, 12, 31), datetime.date(2024, 2, 29),
               datetime.date(2024, 1, 31), datetime.date(1900, 2, 28), datetime.date(9999, 12, 1)]


@st.composite
def date_literal(draw: st.DrawFn) -> str:
    kind = draw(st.integers(0, 9))
    if kind == 0:  # any digits: invalid months, days and year 0000
        return "{:04d}-{:02d}-{:02d}".format(*(draw(st.integers(0, n)) for n in (9999, 99, 99)))
    if kind == 1:  # the last days of months, some of which do not exist
        y, m = draw(st.integers(1, 9999)), draw(st.integers(1, 12))
        return f"{y:04d}-{m:02d}-{draw(st.integers(28, 31)):02d}"
    value = draw(st.one_of(st.sampled_from(_EDGE_DATES), st.dates()))
    return value.isoformat()


@st.composite
def date_step(draw: st.DrawFn) -> str:
    sign = draw(st.sampled_from(["+", "-"]))
    amount = draw(st.one_of(st.integers(0, 40), st.integers(0, 4_000_000),
                            st.integers(0, 10**25)))
    zeros = draw(st.sampled_from(["", "", "", "0", "00"]))
    unit = draw(st.sampled_from(sorted(ref.UNITS)))
    ws = [draw(_WS) for _ in range(3)]
    return f"{ws[0]}{sign}{ws[1]}{zeros}{amount}{ws[2] or draw(st.sampled_from(['', ' ']))}{unit}"


@st.composite
def date_expr(draw: st.DrawFn) -> str:
    return draw(date_literal()) + "".join(draw(st.lists(date_step(), max_size=4)))


@st.composite
def valid_input(draw: st.DrawFn) -> bytes:
    ws = [draw(_WS) for _ in range(6)]
    form = draw(st.sampled_from(["expr", "weekday", "day_of_year", "days_between"]))
    first = draw(date_expr())
    if form == "expr":
        body = first
    elif form == "days_between":
        second = draw(date_expr())
        body = f"days_between{ws[0]}({ws[1]}{first}{ws[2]},{ws[3]}{second}{ws[4]})"
    else:
        body = f"{form}{ws[0]}({ws[1]}{first}{ws[2]})"
    return (ws[5] + body + draw(_WS)).encode()


mutated_input = mutated(valid_input(), st.one_of(
    st.binary(min_size=1, max_size=3),
    st.sampled_from([b"-", b"+", b"0", b"9", b"s", b"(", b",", b" "])))


_TOKENS = [b"2024-02-29", b"9999-12-31", b"0001-01-01", b"2023-02-29", b"+", b"-", b"1", b"12",
           b"99999999999", b"day", b"days", b"month", b"years", b"week", b"weekday",
           b"days_between", b"day_of_year", b"(", b")", b",", b" ", b"\n", b"\xff", b"\xc3\xa9"]
token_soup = st.lists(st.sampled_from(_TOKENS), max_size=12).map(b"".join)


@PROPERTY_TIMEOUT
@PROPERTY
@given(data=valid_input())
def test_differential_valid(guest: Guest, data: bytes) -> None:
    DATE.assert_agree(guest, data)


@PROPERTY_TIMEOUT
@PROPERTY
@given(data=st.one_of(mutated_input, token_soup, st.binary(max_size=40)))
def test_differential_garbage(guest: Guest, data: bytes) -> None:
    DATE.assert_agree(guest, data)


@PROPERTY_TIMEOUT
@PROPERTY
@given(start=st.dates(), months=st.integers(-200, 200))
def test_month_rule_is_clamping(guest: Guest, start: datetime.date, months: int) -> None:
    """`+ N months` is the same month count moved, day clamped (checked against a plain loop)."""
    sign = "+" if months >= 0 else "-"
    outcome = DATE.assert_agree(guest, f"{start} {sign} {abs(months)} months".encode())
    total = start.year * 12 + start.month - 1 + months
    year, month = total // 12, total % 12 + 1
    if 1 <= year <= 9999:
        day = min(start.day, calendar.monthrange(year, month)[1])
        assert outcome[0] == datetime.date(year, month, day).isoformat()
    else:
        assert outcome[1] == "overflow"


# --- limits and bombs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"2024-01-01" + b" + 1 day" * ref.MAX_STEPS, ("2026-09-27", None)),
        (b"2024-01-01" + b" + 1 day" * (ref.MAX_STEPS + 1), (None, "too_large")),
        (b"days_between(2024-01-01" + b"+0day" * 500 + b", 2024-01-02" + b"+0day" * 500 + b")",
         ("1", None)),
        (b"days_between(2024-01-01" + b"+0day" * 500 + b", 2024-01-02" + b"+0day" * 501 + b")",
         (None, "too_large")),
        (b"0001-01-01 + 3652058 days", ("9999-12-31", None)),
        (b"0001-01-01 + 3652059 days", (None, "overflow")),
    ],
    ids=["steps-1000", "steps-1001", "steps-1000-two-dates", "steps-1001-two-dates",
         "range-end", "range-end+1"],
)
def test_limit_pairs(guest: Guest, data: bytes, expected: tuple[str | None, str | None]) -> None:
    assert DATE.assert_agree(guest, data)[:2] == expected


_BOMBS: list[tuple[str, bytes, str | None]] = [
    ("1MiB-of-steps", b"2024-01-01" + b" + 1 day" * (MIB // 8 - 2), "too_large"),
    ("1MiB-number", b"2024-01-01 + " + b"9" * (MIB - 30) + b" days", "overflow"),
    ("1MiB-leading-zeros", b"2024-01-01 + " + b"0" * (MIB - 30) + b"1 days", None),
    ("1MiB-whitespace", b" " * MIB, "syntax"),
    ("1MiB-name", b"a" * MIB, "syntax"),
    ("100000-nested-parens", b"weekday" + b"(" * 100_000 + b")" * 100_000, "syntax"),
    ("1MiB-date-run", b"2024-01-01" * (MIB // 10), "syntax"),
    ("invalid-utf8-at-the-end", b" " * (MIB - 1) + b"\xff", "syntax"),
]


@pytest.mark.parametrize(("data", "code"), [b[1:] for b in _BOMBS], ids=[b[0] for b in _BOMBS])
def test_bombs(default_limits_guest: DefaultLimitsGuest, data: bytes, code: str | None) -> None:
    """A typed guest error (or a value) within the default limits, never a trap or a hang."""
    DATE.check_bomb(default_limits_guest, data, code)


# --- grammar and result regex ---------------------------------------------------------------


@st.composite
def model_input(draw: st.DrawFn) -> str:
    """What grammar.ebnf lets a model write."""

    def sp() -> str:
        return draw(st.sampled_from(["", " "]))

    def expr() -> str:
        digits = draw(st.tuples(st.integers(0, 9999), st.integers(0, 19), st.integers(0, 39)))
        text = "{:04d}-{:02d}-{:02d}".format(*digits)
        for _ in range(draw(st.integers(0, 2))):
            amount = draw(st.one_of(st.just(0), st.integers(1, 99_999)))
            unit = draw(st.sampled_from(sorted(ref.UNITS)))
            text += f"{sp()}{draw(st.sampled_from('+-'))}{sp()}{amount} {unit}"
        return text

    form = draw(st.sampled_from(["expr", "weekday", "day_of_year", "days_between"]))
    if form == "expr":
        return expr()
    if form == "days_between":
        return f"days_between({expr()},{sp()}{expr()})"
    return f"{form}({expr()})"


def test_grammar_never_produces_lt() -> None:
    assert "<" not in DATE.grammar
    DATE.check_cannot_produce_lt()


@PROPERTY_TIMEOUT
@property_settings(full=1_000, quick=60)
@given(text=model_input())
def test_model_grammar_inputs_are_accepted(guest: Guest, text: str) -> None:
    """Whatever the grammar lets a model write, the evaluator parses (no `syntax` error)."""
    DATE.check_model_input(guest, text)


def test_grammar_rejects_what_the_model_may_not_write() -> None:
    assert DATE.grammar_accepts("days_between(2024-01-01, 2024-12-25)")
    for text in ("2024-1-1", "2024-01-01 + 123456 days", "2024-01-01 + 1 day + 1 day + 1 day",
                 "2024-01-01T00:00", "today", "2024-01-01</date>", "weekday(2024-01-01"):
        assert not DATE.grammar_accepts(text), text


def test_result_regex_in_xgrammar_agrees_with_python_re(guest: Guest) -> None:
    extra = ["Funday", "2024-1-1", "-0", "01", "<", "12345678", "-3652058"]
    DATE.check_regex_agrees_with_python_re(guest, extra, minimum=41)


def test_grammar_compiles_for_the_real_tokenizer() -> None:
    """Compiled against SmolLM2's vocabulary, the tokens of a real span walk the matcher."""
    DATE.check_tokens_walk("2024-01-31 + 1 month")
