"""Reference implementation of ``units`` (semantics ``units/1``, docs/semantics/units.md).

``NUMBER UNIT to UNIT`` converted exactly with :class:`fractions.Fraction`. The WASM guest
(``evaluators_wasm/src/units/main.zig``) computes the same rationals with checked i256 integers and
formats them with its own digit-by-digit rounding; this module rounds with ``round()`` on a
scaled fraction instead, so the differential tests compare two independent formatters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from evaluators_wasm.reference import GuestError

__all__ = ["MAX_NUMBER_DIGITS", "SIGNIFICANT_DIGITS", "UNITS", "Unit", "evaluate"]

#: Digits before the point, and after it, as written.
MAX_NUMBER_DIGITS = 15
#: Non-integer results are rounded half-even to this many significant digits.
SIGNIFICANT_DIGITS = 15


@dataclass(frozen=True)
class Unit:
    """``value_in_base = (value + offset) * factor``; base units m, kg, L, s, byte, K."""

    dimension: str
    factor: Fraction
    offset: Fraction = Fraction(0)


def _table() -> dict[str, Unit]:
    rows: list[tuple[str, str, tuple[str, ...]]] = [
        ("length", "1", ("m", "meter", "meters", "metre", "metres")),
        ("length", "1000", ("km", "kilometer", "kilometers", "kilometre", "kilometres")),
        ("length", "0.01", ("cm", "centimeter", "centimeters", "centimetre", "centimetres")),
        ("length", "0.001", ("mm", "millimeter", "millimeters", "millimetre", "millimetres")),
        ("length", "0.000001", ("um", "\u00b5m", "\u03bcm", "micrometer", "micrometers",
                                "micrometre", "micrometres")),
        ("length", "0.000000001", ("nm", "nanometer", "nanometers", "nanometre", "nanometres")),
        ("length", "0.0254", ("in", "inch", "inches")),
        ("length", "0.3048", ("ft", "foot", "feet")),
        ("length", "0.9144", ("yd", "yard", "yards")),
        ("length", "1609.344", ("mi", "mile", "miles")),
        ("length", "1852", ("nmi",)),
        ("mass", "1", ("kg", "kilogram", "kilograms")),
        ("mass", "0.001", ("g", "gram", "grams")),
        ("mass", "0.000001", ("mg", "milligram", "milligrams")),
        ("mass", "0.000000001", ("ug", "\u00b5g", "\u03bcg", "microgram", "micrograms")),
        ("mass", "1000", ("t", "tonne", "tonnes")),
        ("mass", "0.45359237", ("lb", "lbs", "pound", "pounds")),
        ("mass", "0.028349523125", ("oz", "ounce", "ounces")),
        ("mass", "6.35029318", ("st", "stone")),
        ("mass", "0.00006479891", ("gr", "grain", "grains")),
        ("volume", "1", ("L", "l", "liter", "liters", "litre", "litres")),
        ("volume", "0.001", ("mL", "ml", "milliliter", "milliliters", "millilitre", "millilitres")),
        ("volume", "0.01", ("cL", "cl")),
        ("volume", "0.1", ("dL", "dl")),
        ("volume", "1000", ("m3", "m\u00b3")),
        ("volume", "0.001", ("cm3", "cm\u00b3", "cc")),
        ("volume", "0.016387064", ("in3", "in\u00b3")),
        ("volume", "28.316846592", ("ft3", "ft\u00b3")),
        ("volume", "3.785411784", ("gal", "gallon", "gallons")),
        ("volume", "0.946352946", ("qt", "quart", "quarts")),
        ("volume", "0.473176473", ("pt", "pint", "pints")),
        ("volume", "0.2365882365", ("cup", "cups")),
        ("volume", "0.0295735295625", ("floz", "fl_oz")),
        ("volume", "0.01478676478125", ("tbsp", "tablespoon", "tablespoons")),
        ("volume", "0.00492892159375", ("tsp", "teaspoon", "teaspoons")),
        ("volume", "4.54609", ("imp_gal",)),
        ("volume", "0.56826125", ("imp_pt",)),
        ("volume", "0.0284130625", ("imp_floz",)),
        ("time", "1", ("s", "sec", "second", "seconds")),
        ("time", "0.001", ("ms", "millisecond", "milliseconds")),
        ("time", "0.000001", ("us", "\u00b5s", "\u03bcs", "microsecond", "microseconds")),
        ("time", "0.000000001", ("ns", "nanosecond", "nanoseconds")),
        ("time", "60", ("min", "minute", "minutes")),
        ("time", "3600", ("h", "hr", "hour", "hours")),
        ("time", "86400", ("d", "day", "days")),
        ("time", "604800", ("wk", "week", "weeks")),
        ("data", "0.125", ("bit", "bits")),
        ("data", "1", ("B", "byte", "bytes")),
        ("data", "1000", ("kB",)),
        ("data", "1000000", ("MB",)),
        ("data", "1000000000", ("GB",)),
        ("data", "1000000000000", ("TB",)),
        ("data", "1000000000000000", ("PB",)),
        ("data", "1000000000000000000", ("EB",)),
        ("data", str(2**10), ("KiB",)),
        ("data", str(2**20), ("MiB",)),
        ("data", str(2**30), ("GiB",)),
        ("data", str(2**40), ("TiB",)),
        ("data", str(2**50), ("PiB",)),
        ("data", str(2**60), ("EiB",)),
        ("data", "125", ("kbit",)),
        ("data", "125000", ("Mbit",)),
        ("data", "125000000", ("Gbit",)),
        ("data", "125000000000", ("Tbit",)),
    ]
    table = {name: Unit(dim, Fraction(factor)) for dim, factor, names in rows for name in names}
    temperatures = [
        (Unit("temperature", Fraction(1)), ("K", "kelvin")),
        (Unit("temperature", Fraction(1), Fraction("273.15")), ("C", "\u00b0C", "degC", "celsius")),
        (Unit("temperature", Fraction(5, 9), Fraction("459.67")),
         ("F", "\u00b0F", "degF", "fahrenheit")),
        (Unit("temperature", Fraction(5, 9)), ("R", "\u00b0R", "degR", "rankine")),
    ]
    for unit, names in temperatures:
        table.update(dict.fromkeys(names, unit))
    return table


#: Every accepted unit name (case-sensitive) and what it means.
UNITS: dict[str, Unit] = _table()

_NUMBER = re.compile(rb"[ \t\n\r]*(-?)([0-9]*)(?:(\.)([0-9]*))?")
_SPACE = re.compile(rb"[ \t\n\r]+")


def evaluate(data: bytes) -> str:
    """Evaluates one ``units`` span; raises :class:`GuestError` with the guest's code."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise GuestError("syntax", "input is not valid UTF-8") from None
    number = _NUMBER.match(data)
    assert number is not None  # every part may be empty
    sign, int_digits, point, frac_digits = number.groups()
    if not int_digits:
        raise GuestError("syntax", "expected a number such as 12.5")
    if point and not frac_digits:
        raise GuestError("syntax", "a decimal point must be followed by digits")
    tokens = [t for t in _SPACE.split(data[number.end() :]) if t]
    if len(tokens) != 3 or tokens[1] != b"to":
        raise GuestError("syntax", "expected NUMBER UNIT to UNIT, as in 12.5 km to mi")
    source, target = _unit(tokens[0]), _unit(tokens[2])
    if len(int_digits) > MAX_NUMBER_DIGITS or len(frac_digits or b"") > MAX_NUMBER_DIGITS:
        raise GuestError("too_large", "at most 15 digits before and 15 after the decimal point")
    if source.dimension != target.dimension:
        raise GuestError("domain", f"cannot convert {source.dimension} to {target.dimension}")
    value = Fraction((sign + int_digits + b"." + (frac_digits or b"0")).decode())
    if source.dimension != "temperature":
        return format_value(value * source.factor / target.factor)
    kelvin = (value + source.offset) * source.factor
    if kelvin < 0:
        raise GuestError("domain", "below absolute zero")
    return format_value(kelvin / target.factor - target.offset)


def _unit(token: bytes) -> Unit:
    unit = UNITS.get(token.decode("utf-8"))
    if unit is None:
        raise GuestError("syntax", f"unknown unit {token.decode('utf-8')!r}")
    return unit


def format_value(value: Fraction) -> str:
    """An integer in full; otherwise half-even to 15 significant digits, no exponent."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    magnitude = abs(value)
    # exponent e with 10**e <= magnitude < 10**(e + 1)
    e = len(str(magnitude.numerator)) - len(str(magnitude.denominator))
    if magnitude < Fraction(10) ** e:
        e -= 1
    shift = SIGNIFICANT_DIGITS - 1 - e  # digits kept after the point (negative: zeros before it)
    digits = round(magnitude * Fraction(10) ** shift)  # round() on a Fraction is half-even
    if shift <= 0:
        return sign + str(digits * 10**-shift)
    text = str(digits).rjust(shift + 1, "0")
    whole, fraction = text[:-shift], text[-shift:].rstrip("0")
    return sign + whole + ("." + fraction if fraction else "")
