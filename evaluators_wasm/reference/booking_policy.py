"""Reference implementation of the example policy ``booking_policy`` (semantics
``booking_policy/1``, evaluators_wasm/examples/booking_policy/main.zig).

Reads one JSON object ``{"age": int|null, "components": [number, ...]}`` and returns the compact
JSON ``{"total": number|null, "action": ..., "reason": ...}``:

=========================================  =================  ==================
age or components missing, null or empty   escalate_human     insufficient_info
age < 18                                   decline            under_age
age > 70                                   decline            over_age
total <= 10000                             book_appointment   eligible
10000 < total <= 12000                     offer_alternative  over_limit
total > 12000                              decline            over_limit
=========================================  =================  ==================

``total`` is the exact decimal sum of the components, in plain notation without trailing
fractional zeros (``null`` when there are none). Numbers follow the guest library's exact
decimals (``evald_json.zig``'s ``Decimal``): units in a signed 64-bit integer, at most 18
significant digits as written, scale at most 18, exponents up to 1000; beyond them
``too_large``. Input that is not one JSON value (invalid UTF-8, a lone surrogate, ``NaN``,
nesting deeper than 32) is ``syntax``; so is an object whose age is not an integer or null, or
whose components are not numbers; a negative component is ``domain``. The guest must agree
with this module on every input, error codes included.
"""

from __future__ import annotations

import json
import re
from typing import Any

from evaluators_wasm.reference import GuestError

__all__ = [
    "MAX_DEPTH",
    "JsonNumber",
    "decimal_text",
    "evaluate",
    "exact_decimal",
    "parse_json",
    "policy",
]

MAX_DEPTH = 32
_I64 = 2**63 - 1
_MAX_SCALE = 18
_MAX_EXPONENT = 1000
_NUMBER = re.compile(r"(-?)(0|[1-9][0-9]*)(?:\.([0-9]+))?(?:[eE]([+-]?[0-9]+))?")


class JsonNumber(str):
    """A JSON number's text, as the guest libraries keep it."""


def exact_decimal(text: str) -> tuple[int, int] | None:
    """``(units, scale)`` as ``Decimal.parse`` reads the number, or None beyond its range."""
    match = _NUMBER.fullmatch(text)
    assert match is not None  # json only hands over numbers in this form
    sign, whole, fraction, exponent = match.groups()
    digits = (whole + (fraction or "")).lstrip("0")
    if len(digits) > 18:
        return None
    written = int(exponent or "0")
    if abs(written) > _MAX_EXPONENT:
        return None
    units = int(whole + (fraction or ""))
    scale = len(fraction or "") - written
    if scale < 0:
        units *= 10**-scale
        scale = 0
        if units > _I64:
            return None
    while scale > _MAX_SCALE and units % 10 == 0:
        units //= 10
        scale -= 1
    if scale > _MAX_SCALE:
        return None
    return (-units if sign else units), scale


def _add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    scale = max(a[1], b[1])
    x, y = a[0] * 10 ** (scale - a[1]), b[0] * 10 ** (scale - b[1])
    if abs(x) > _I64 or abs(y) > _I64 or abs(x + y) > _I64:
        return None
    return x + y, scale


def decimal_text(value: tuple[int, int]) -> str:
    """Plain notation, trailing fractional zeros dropped (the guest writer's form)."""
    units, scale = value
    while scale > 0 and units % 10 == 0:
        units //= 10
        scale -= 1
    digits = str(abs(units)).rjust(scale + 1, "0")
    body = f"{digits[: len(digits) - scale]}.{digits[len(digits) - scale :]}" if scale else digits
    return ("-" if units < 0 else "") + body


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _strings_are_utf8(value: Any) -> bool:
    """False when a string (or key) holds a lone surrogate (``"\\ud800"``), as the guest's
    reader refuses."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_strings_are_utf8(key) and _strings_are_utf8(v) for key, v in value.items())
    if isinstance(value, list):
        return all(map(_strings_are_utf8, value))
    return True


def parse_json(data: bytes) -> Any:
    """One JSON value as the SDK's guest readers accept it (numbers as :class:`JsonNumber`),
    or :class:`GuestError` ``syntax`` as they refuse it."""
    try:
        value = json.loads(
            data.decode("utf-8"),
            parse_int=JsonNumber,
            parse_float=JsonNumber,
            parse_constant=_refuse_constant,
        )
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise GuestError("syntax", "the input is not one JSON value") from None
    if _depth(value) > MAX_DEPTH:
        raise GuestError("syntax", "the input nests arrays and objects too deeply")
    if not _strings_are_utf8(value):
        raise GuestError("syntax", "the input is not one JSON value")
    return value


def policy(age: int | None, total: tuple[int, int] | None) -> tuple[str, str]:
    """``(action, reason)`` for an age and an exact total ``(units, scale)``."""
    if age is None or total is None:
        return "escalate_human", "insufficient_info"
    if age < 18:
        return "decline", "under_age"
    if age > 70:
        return "decline", "over_age"
    units, scale = total
    if units <= 10000 * 10**scale:
        return "book_appointment", "eligible"
    if units <= 12000 * 10**scale:
        return "offer_alternative", "over_limit"
    return "decline", "over_limit"


def _age(value: Any) -> int | None:
    if value is None:
        return None
    exact = exact_decimal(value) if isinstance(value, JsonNumber) else None
    if exact is None or exact[0] % 10 ** exact[1] != 0:
        raise GuestError("syntax", "age must be an integer or null")
    units, scale = exact
    whole: int = units // 10**scale
    return whole


def evaluate(data: bytes) -> str:
    """Evaluates one ``booking_policy`` input; raises :class:`GuestError` with the guest's code."""
    value = parse_json(data)
    if not isinstance(value, dict):
        raise GuestError("syntax", "expected a JSON object with age and components")
    age = _age(value.get("age"))
    components = value.get("components", [])
    if components is not None and not isinstance(components, list):
        raise GuestError("syntax", "components must be an array of numbers or null")
    total: tuple[int, int] | None = None
    for component in components or ():
        if not isinstance(component, JsonNumber):
            raise GuestError("syntax", "components must be numbers")
        amount = exact_decimal(component)
        if amount is None:
            raise GuestError("too_large", "a component has more than 18 digits or decimals")
        if amount[0] < 0:
            raise GuestError("domain", "a component is negative")
        total = amount if total is None else _add(total, amount)
        if total is None:
            raise GuestError("too_large", "the total has more than 18 digits")
    action, reason = policy(age, total)
    shown = "null" if total is None else decimal_text(total)
    return f'{{"total":{shown},"action":"{action}","reason":"{reason}"}}'
