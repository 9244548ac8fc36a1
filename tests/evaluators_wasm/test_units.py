"""units: conformance cases, WASM-vs-reference differential tests, bounds, bombs and the grammar.

The conformance file (evaluators_wasm/conformance/units.jsonl) holds hand-written cases whose
values were checked with Python's ``decimal`` at 80 digits, not with either implementation.
Hypothesis then checks that the WASM guest (checked i256 rationals, digit-by-digit rounding) and
the Python reference (``Fraction`` and ``round``) agree — value or error code — on generated
conversions, mutated ones and garbage.
"""

from __future__ import annotations

import itertools
import re
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evaluators_wasm.reference.units import MAX_NUMBER_DIGITS, UNITS, format_value
from tests.evaluators_wasm.support import (
    DEFAULT_LIMITS,
    FULL,
    PROPERTY_TIMEOUT,
    DefaultLimitsGuest,
    Evaluator,
    Guest,
    mutated,
    property_settings,
)

UNITS_EV = Evaluator("units", {"syntax", "domain", "too_large"}, compare_messages=False)
INPUT_CAP = DEFAULT_LIMITS.input_bytes
DIMENSIONS = ("length", "mass", "volume", "time", "data", "temperature")


@pytest.mark.parametrize("case", UNITS_EV.cases, ids=UNITS_EV.case_id)
def test_conformance(case: dict[str, Any], guest: Guest) -> None:
    UNITS_EV.check_case(guest, case)


def test_conformance_covers_every_dimension_and_error() -> None:
    words = [t for c in UNITS_EV.cases for t in str(c.get("input", "")).split()]
    used = {UNITS[t].dimension for t in words if t in UNITS}
    assert used == set(DIMENSIONS)
    assert UNITS_EV.case_codes() == UNITS_EV.error_codes


# --- differential: generated inputs -------------------------------------------------------

UNIT_NAMES = sorted(UNITS)
NAMES_BY_DIMENSION = {d: [n for n in UNIT_NAMES if UNITS[n].dimension == d] for d in DIMENSIONS}
SPACE = st.text(" \t\n\r", max_size=2)
SEPARATOR = st.text(" \t\n\r", min_size=1, max_size=2)


@st.composite
def numbers(draw: st.DrawFn) -> str:
    int_len = draw(st.integers(1, MAX_NUMBER_DIGITS + 2))
    frac_len = draw(st.sampled_from([0, 0, 1, 2, 3, 6, 14, 15, 16]))
    digits = st.text("0123456789", min_size=1, max_size=1)
    whole = "".join(draw(digits) for _ in range(int_len))
    if draw(st.booleans()):
        whole = whole.lstrip("0") or "0"
    text = whole + ("." + "".join(draw(digits) for _ in range(frac_len)) if frac_len else "")
    return ("-" if draw(st.integers(0, 3)) == 0 else "") + text


@st.composite
def conversions(draw: st.DrawFn) -> str:
    dimension = draw(st.sampled_from(DIMENSIONS))
    source = draw(st.sampled_from(NAMES_BY_DIMENSION[dimension]))
    same = draw(st.integers(0, 9)) > 0
    target = draw(st.sampled_from(NAMES_BY_DIMENSION[dimension] if same else UNIT_NAMES))
    if dimension == "temperature" and draw(st.booleans()):  # near absolute zero
        number = draw(st.sampled_from(["-273.15", "-273.150000000001", "-459.67", "-459.670000001",
                                       "0", "-0", "0.000000000000001", "-0.000000000000001"]))
    else:
        number = draw(numbers())
    return (f"{draw(SPACE)}{number}{draw(SPACE)}{source}{draw(SEPARATOR)}to"
            f"{draw(SEPARATOR)}{target}{draw(SPACE)}")


mutated_conversion = mutated(
    conversions().map(str.encode),
    st.one_of(st.sampled_from(list(b"-.0 9tokmKB\t\xb5\xc2\xff")), st.integers(0, 255)).map(
        lambda byte: bytes([byte])),
)


DIFF_SETTINGS = property_settings()


@PROPERTY_TIMEOUT
@DIFF_SETTINGS
@given(text=conversions())
def test_differential_generated(guest: Guest, text: str) -> None:
    UNITS_EV.assert_agree(guest, text.encode("utf-8"))


@PROPERTY_TIMEOUT
@DIFF_SETTINGS
@given(data=mutated_conversion)
def test_differential_mutated(guest: Guest, data: bytes) -> None:
    UNITS_EV.assert_agree(guest, data)


@PROPERTY_TIMEOUT
@DIFF_SETTINGS
@given(data=st.one_of(st.binary(max_size=30),
                      st.text(st.sampled_from("0123456789.- kmto"), max_size=20).map(str.encode)))
def test_differential_garbage(guest: Guest, data: bytes) -> None:
    UNITS_EV.assert_agree(guest, data)


@property_settings()
@given(numerator=st.integers(-(10**40), 10**40), denominator=st.integers(1, 10**40))
def test_formatting_rounds_half_even_to_15_digits(numerator: int, denominator: int) -> None:
    """The reference's formatter checked against the definition of correct rounding: the text
    is a multiple of one unit in the 15th significant place of the value, at most half a unit
    away, and on a tie its last digit is even."""
    value = Fraction(numerator, denominator)
    text = format_value(value)
    assert "e" not in text.lower() and text != "-0"
    if value.denominator == 1:
        assert text == str(value.numerator)
        return
    assert "." not in text or not text.endswith("0")
    exponent = 0  # 10**exponent <= |value| < 10**(exponent + 1)
    while Fraction(10) ** exponent > abs(value):
        exponent -= 1
    while Fraction(10) ** (exponent + 1) <= abs(value):
        exponent += 1
    unit = Fraction(10) ** (exponent - 14)
    steps = Fraction(text) / unit
    assert steps.denominator == 1
    error = abs(Fraction(text) - value)
    assert error <= unit / 2
    if error == unit / 2:
        assert steps.numerator % 2 == 0


# --- every unit pair at the extremes: the i256 bound in practice ----------------------------

def _one_name_per_unit() -> list[str]:
    seen: dict[tuple[str, Fraction, Fraction], str] = {}
    for name in UNIT_NAMES:
        unit = UNITS[name]
        seen.setdefault((unit.dimension, unit.factor, unit.offset), name)
    return sorted(seen.values())


EXTREME_PAIRS = [
    (a, b) for a, b in itertools.product(_one_name_per_unit(), repeat=2)
    if UNITS[a].dimension == UNITS[b].dimension
]


@pytest.mark.parametrize("number", ["999999999999999.999999999999999", "0.000000000000001",
                                    "-999999999999999.999999999999999"])
def test_every_pair_at_the_extremes(guest: Guest, number: str) -> None:
    """No pair of units overflows the guest's i256 arithmetic, and both sides agree."""
    if not FULL and number.startswith("-"):
        pytest.skip("the negative extreme runs in the full profile")
    for source, target in EXTREME_PAIRS:
        data = f"{number} {source} to {target}".encode()
        value, code, message = guest(UNITS_EV.name, data)
        assert (value, code) == UNITS_EV.reference_outcome(data)[:2], (data, message)
        if UNITS[source].dimension != "temperature" or not number.startswith("-"):
            assert code is None, (data, message)


def test_intermediate_values_fit_i256() -> None:
    """The bound of docs/semantics/units.md ("Why i256 suffices"): the largest numerator and
    denominator a linear conversion forms (before any reduction) stay below 2**196 and 2**147."""
    n_max, scale_max = 10**30, 10**15
    assert max(u.factor.numerator for u in UNITS.values()) <= 2**60
    assert max(u.factor.denominator for u in UNITS.values()) <= 10**11
    for source, target in EXTREME_PAIRS:
        f, g = UNITS[source].factor, UNITS[target].factor
        assert n_max * f.numerator * g.denominator < 2**196
        assert scale_max * f.denominator * g.numerator < 2**147


# --- bombs: typed answers within the host's default limits --------------------------------

def _pad(prefix: bytes, unit: bytes, suffix: bytes) -> bytes:
    k = (INPUT_CAP - len(prefix) - len(suffix)) // len(unit)
    return prefix + unit * k + suffix


@pytest.mark.parametrize("data,code", [
    (_pad(b"", b"9", b" km to m"), "too_large"),  # a 1 MB number
    (_pad(b"0.", b"1", b" km to m"), "too_large"),
    (_pad(b"-", b"0", b" C to K"), "too_large"),
    (_pad(b"1 ", b"k", b" to m"), "syntax"),  # a 1 MB unit name
    (_pad(b"1 km", b" ", b"to m"), None),  # a megabyte of spaces between the words
    (_pad(b"1 km to m", b" ", b""), None),  # trailing whitespace is fine
    (_pad(b"", b" ", b"1 km to m"), None),
    (_pad(b"1 km to m ", b"to ", b""), "syntax"),
    (_pad(b"", "é".encode(), b""), "syntax"),
    (_pad(b"1 km to m", b"\xff", b""), "syntax"),
])
def test_bombs_answered_within_default_fuel(default_limits_guest: DefaultLimitsGuest,
                                            data: bytes, code: str | None) -> None:
    assert len(data) > INPUT_CAP - 16
    UNITS_EV.check_bomb(default_limits_guest, data, code)


# --- the grammar a model writes in ---------------------------------------------------------

def test_grammar_lists_exactly_the_unit_table() -> None:
    rules = dict(line.split(" ::= ", 1) for line in UNITS_EV.grammar.splitlines() if line.strip())
    for dimension in DIMENSIONS:
        # An alternative may be split into adjacent literals ("°" "C"): see the next test.
        names = ["".join(re.findall(r'"([^"]*)"', alt)) for alt in rules[dimension].split(" | ")]
        assert sorted(names) == NAMES_BY_DIMENSION[dimension], dimension
    assert "<" not in UNITS_EV.grammar
    assert "<" not in UNITS_EV.manifest["result_regex"]


def test_grammar_never_puts_a_hex_digit_after_a_non_ascii_character() -> None:
    """xgrammar 0.2.7 prints a non-ASCII character as ``\\xNN`` and, with its compile cache on,
    re-parses the grammar from that text: ``"°C"`` comes back as U+0B0C. The literals are split
    there (``"°" "C"``), and the grammar test below compiles with the cache on, as engines do."""
    for literal in re.findall(r'"([^"]*)"', UNITS_EV.grammar):
        assert not re.search(r"[^\x00-\x7f][0-9A-Fa-f]", literal), literal


GRAMMAR_ACCEPTS = ["12.5 km to mi", "12.5km to mi", "-40 C to F", "98.6 °F to °C", "1 µm to nm",
                   "0.000000001 GiB to bit", "100 kg to lb", "3 imp_gal to L", "1 wk to min",
                   "999999999999999.999999999999999 EiB to bit"]
GRAMMAR_REJECTS = ["1 km to kg", "1 KB to B", "1 month to d", "1.5.5 km to m", "1e3 m to km",
                   "1234567890123456 m to km", "1 km  to mi", "1 km in mi", ".5 km to m",
                   "007 km to m", "1 km to mi<"]


@pytest.mark.parametrize("text", GRAMMAR_ACCEPTS)
def test_grammar_accepts_and_guest_evaluates(guest: Guest, text: str) -> None:
    UNITS_EV.check_model_example(guest, text)


@pytest.mark.parametrize("text", GRAMMAR_REJECTS)
def test_grammar_rejects(text: str) -> None:
    assert not UNITS_EV.grammar_accepts(text)


def test_grammar_accepts_every_unit_name() -> None:
    for name in UNIT_NAMES:
        assert UNITS_EV.grammar_accepts(f"1 {name} to {name}"), name


def test_result_regex_compiles() -> None:
    assert UNITS_EV.regex_accepts("-12.5") and not UNITS_EV.regex_accepts("12.50")


def test_grammar_compiles_for_the_real_tokenizer() -> None:
    """Compiled against SmolLM2's vocabulary, the tokens of a real span walk the matcher."""
    UNITS_EV.check_tokens_walk("98.6 °F to °C")
