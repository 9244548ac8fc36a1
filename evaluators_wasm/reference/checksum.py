"""Reference implementation of ``checksum`` (semantics ``checksum/1``, docs/semantics/checksum.md).

``crc32("text")`` and ``sha256("text")`` hash the UTF-8 bytes of a string literal; ``luhn_digit``,
``luhn_valid``, ``isbn10_digit``, ``isbn10_valid``, ``isbn13_digit`` and ``isbn13_valid`` work on
digit strings. The WASM guest (``evaluators_wasm/src/checksum/main.zig``) must agree with
this module on every input, error codes included; the differential tests check that.
"""

from __future__ import annotations

import hashlib
import re
import zlib

from evaluators_wasm.reference import GuestError

__all__ = ["MAX_DIGITS", "evaluate"]

#: Digit-string arguments with more digits than this (separators not counted) are ``too_large``.
MAX_DIGITS = 1000

_SPACE = b" \t\n\r"
_CALL = re.compile(rb"[ \t\n\r]*([A-Za-z0-9_]*)[ \t\n\r]*")
_ESCAPES = {b'"': b'"', b"\\": b"\\", b"n": b"\n", b"t": b"\t"}
# A literal: runs without quote or backslash, each backslash taking the byte after it.
_LITERAL = re.compile(rb'"([^"\\]*(?:\\.[^"\\]*)*)"', re.DOTALL)
_ESCAPE = re.compile(rb"\\(?:u([0-9A-Fa-f]{4})|(.))", re.DOTALL)
_DIGIT_FUNCTIONS = frozenset(
    {"luhn_digit", "luhn_valid", "isbn10_digit", "isbn10_valid", "isbn13_digit", "isbn13_valid"}
)


def evaluate(data: bytes) -> str:
    """Evaluates one ``checksum`` span; raises :class:`GuestError` with the guest's code."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise GuestError("syntax", "input is not valid UTF-8") from None
    match = _CALL.match(data)
    assert match is not None  # every part of the pattern may be empty
    name = match.group(1).decode("ascii")
    if name not in _DIGIT_FUNCTIONS and name not in ("crc32", "sha256"):
        raise GuestError("syntax", "expected a checksum function name")
    pos = match.end()
    if data[pos : pos + 1] != b"(":
        raise GuestError("syntax", "expected ( after the function name")
    pos = _skip_space(data, pos + 1)
    pos, argument = _parse_string(data, pos)
    pos = _skip_space(data, pos)
    if data[pos : pos + 1] != b")":
        raise GuestError("syntax", "expected ) after the argument")
    if _skip_space(data, pos + 1) != len(data):
        raise GuestError("syntax", "unexpected text after the closing )")
    if name == "crc32":
        return f"{zlib.crc32(argument):08x}"
    if name == "sha256":
        return hashlib.sha256(argument).hexdigest()
    return _digit_function(name, _digits(argument, allow_x=name == "isbn10_valid"))


def _skip_space(data: bytes, pos: int) -> int:
    while pos < len(data) and data[pos] in _SPACE:
        pos += 1
    return pos


def _parse_string(data: bytes, pos: int) -> tuple[int, bytes]:
    """Decodes the literal at ``pos``; returns the index after its closing quote and its bytes."""
    if data[pos : pos + 1] != b'"':
        raise GuestError("syntax", 'expected a string literal "..."')
    literal = _LITERAL.match(data, pos)
    if literal is None:
        raise GuestError("syntax", "unterminated string literal")
    body = literal.group(1)
    if b"\\" in body:
        body = _ESCAPE.sub(_decode_escape, body)
    return literal.end(), body


def _decode_escape(escape: re.Match[bytes]) -> bytes:
    hex_digits, simple = escape.group(1), escape.group(2)
    if hex_digits is not None:
        code_point = int(hex_digits, 16)
        if 0xD800 <= code_point <= 0xDFFF:
            raise GuestError("syntax", "\\u escape of a surrogate (D800-DFFF)")
        return chr(code_point).encode("utf-8")
    if simple in _ESCAPES:
        return _ESCAPES[simple]
    raise GuestError("syntax", 'unknown escape; use \\" \\\\ \\n \\t or \\uXXXX (four hex digits)')


def _digits(argument: bytes, *, allow_x: bool) -> list[int]:
    """Digit values (``X`` is 10) with spaces and hyphens dropped; ``X`` only last, if allowed."""
    compact = argument.replace(b" ", b"").replace(b"-", b"")
    body, last = compact[:-1], compact[-1:]
    if allow_x and last in (b"X", b"x"):
        if not (body.isdigit() or body == b""):
            raise GuestError("syntax", "a digit string holds only digits 0-9, spaces and hyphens")
        digits = [*body, ord("0") + 10]
    else:
        if not compact.isdigit() and compact != b"":
            raise GuestError("syntax", "a digit string holds only digits 0-9, spaces and hyphens")
        digits = list(compact)
    if not digits:
        raise GuestError("syntax", "the digit string has no digits")
    if len(digits) > MAX_DIGITS:
        raise GuestError("too_large", f"more than {MAX_DIGITS} digits")
    return [d - ord("0") for d in digits]


def _digit_function(name: str, digits: list[int]) -> str:
    if name == "luhn_digit":
        return str(_luhn_check_digit(digits))
    if name == "luhn_valid":
        if len(digits) < 2:
            raise GuestError("domain", "luhn_valid needs at least 2 digits")
        return _bool(_luhn_check_digit(digits[:-1]) == digits[-1])
    expected = {"isbn10_digit": 9, "isbn10_valid": 10, "isbn13_digit": 12, "isbn13_valid": 13}[name]
    if len(digits) != expected:
        raise GuestError("domain", f"{name} needs exactly {expected} digits")
    if name == "isbn10_digit":
        return _isbn10_text(_isbn10_check_digit(digits))
    if name == "isbn10_valid":
        return _bool(_isbn10_check_digit(digits[:9]) == digits[9])
    if name == "isbn13_digit":
        return str(_isbn13_check_digit(digits))
    return _bool(_isbn13_check_digit(digits[:12]) == digits[12])


def _luhn_check_digit(payload: list[int]) -> int:
    total = 0
    for i, d in enumerate(reversed(payload)):
        if i % 2 == 0:  # the rightmost payload digit is doubled (the check digit follows it)
            d = d * 2 - 9 if d * 2 > 9 else d * 2
        total += d
    return (10 - total % 10) % 10


def _isbn10_check_digit(payload: list[int]) -> int:
    total = sum(d * (10 - i) for i, d in enumerate(payload))
    return (11 - total % 11) % 11


def _isbn13_check_digit(payload: list[int]) -> int:
    total = sum(d * (3 if i % 2 else 1) for i, d in enumerate(payload))
    return (10 - total % 10) % 10


def _isbn10_text(digit: int) -> str:
    return "X" if digit == 10 else str(digit)


def _bool(value: bool) -> str:
    return "true" if value else "false"
