"""Reference implementation of ``strop/1`` (docs/semantics/strop.md).

A single left-to-right pass: each call is evaluated as soon as its closing parenthesis is read,
and the first problem found is the error reported. The WASM guest
(``evaluators_wasm/src/strop/main.zig``) has the same structure, which is what keeps the two in
agreement on *which* error an input with several problems gets. Strings are Python ``str`` (code
points); case mapping uses the table below, never ``str.upper``/``str.lower``, whose full Unicode
mapping is far larger than the documented one.
"""

from __future__ import annotations

from evaluators_wasm.reference import GuestError

__all__ = [
    "LOWER_TO_UPPER",
    "MAX_DEPTH",
    "MAX_INT_ABS",
    "MAX_OUTPUT_BYTES",
    "MAX_STRING",
    "MAX_TOTAL",
    "UPPER_TO_LOWER",
    "evaluate",
]

MAX_STRING = 100_000
"""Code points in any one string value (literal or result)."""
MAX_TOTAL = 1_000_000
"""Code points summed over every string value created while evaluating one input."""
MAX_DEPTH = 16
"""Calls nested inside each other."""
MAX_INT_ABS = 999_999_999
"""Largest magnitude of an integer literal."""
MAX_OUTPUT_BYTES = 65_536
"""The guest's output buffer."""


def _case_pairs() -> list[tuple[int, int]]:
    """(upper, lower) pairs of the case table; each pair agrees with Unicode's simple mapping."""
    pairs = [(u, u + 32) for u in range(0x41, 0x5B)]  # ASCII A-Z
    pairs += [(u, u + 32) for u in range(0xC0, 0xDF) if u != 0xD7]  # Latin-1, not U+00D7
    pairs.append((0x178, 0xFF))  # Y WITH DIAERESIS
    pairs += [(u, u + 32) for u in range(0x391, 0x3AC) if u != 0x3A2]  # Greek, incl. dialytika
    pairs += [(0x386, 0x3AC), (0x388, 0x3AD), (0x389, 0x3AE), (0x38A, 0x3AF)]
    pairs += [(0x38C, 0x3CC), (0x38E, 0x3CD), (0x38F, 0x3CE)]  # Greek with tonos
    pairs += [(u, u + 32) for u in range(0x410, 0x430)]  # Cyrillic U+0410-U+042F
    pairs += [(u, u + 80) for u in range(0x400, 0x410)]  # Cyrillic U+0400-U+040F
    return pairs


UPPER_TO_LOWER: dict[int, int] = {u: lo for u, lo in _case_pairs()}
"""``lower``: every code point not in this table is unchanged."""
LOWER_TO_UPPER: dict[int, int] = {lo: u for u, lo in _case_pairs()} | {0x3C2: 0x3A3}
"""``upper``: the table's pairs plus final sigma (ς → Σ); other code points are unchanged."""

_STR, _INT, _ANY = "str", "int", "any"
# name -> (parameter types, result type)
_FUNCTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "count": ((_STR, _STR), _INT),
    "len": ((_STR,), _INT),
    "reverse": ((_STR,), _STR),
    "upper": ((_STR,), _STR),
    "lower": ((_STR,), _STR),
    "substr": ((_STR, _INT, _INT), _STR),
    "index": ((_STR, _STR), _INT),
    "replace": ((_STR, _STR, _STR), _STR),
}
_WHITESPACE = " \t\n\r"
_NAME_SHOWN = 24  # characters of an unknown name quoted in the message
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t"}
_HEX = "0123456789abcdefABCDEF"

Value = str | int


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.total = 0  # code points of every string value created so far

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip_ws(self) -> None:
        while self.peek() and self.peek() in _WHITESPACE:
            self.pos += 1

    def fail(self, what: str) -> GuestError:
        offset = len(self.text[: self.pos].encode("utf-8"))
        return GuestError("syntax", f"{what} at byte {offset}")

    def expect(self, char: str) -> None:
        self.skip_ws()
        if self.peek() != char:
            raise self.fail(f"expected '{char}'")
        self.pos += 1

    def new_string(self, value: str) -> str:
        """Admits a string value under the per-string and per-input limits."""
        if len(value) > MAX_STRING:
            raise GuestError("too_large", f"string of {len(value)} code points (max {MAX_STRING})")
        self.total += len(value)
        if self.total > MAX_TOTAL:
            raise GuestError("too_large", f"strings total over {MAX_TOTAL} code points")
        return value

    def expr(self, want: str, depth: int) -> Value:
        self.skip_ws()
        c = self.peek()
        if c == '"':
            if want == _INT:
                raise self.fail("expected an integer")
            return self.new_string(self.literal())
        if c == "-" or (c.isascii() and c.isdigit()):
            if want == _STR:
                raise self.fail("expected a string")
            return self.integer()
        if "a" <= c <= "z":
            return self.call(want, depth)
        raise self.fail("expected a string, an integer or a call")

    def literal(self) -> str:
        self.pos += 1  # the opening quote
        out: list[str] = []
        text = self.text
        while True:
            if self.pos >= len(text):
                raise self.fail("unterminated string")
            c = text[self.pos]
            if c == '"':
                self.pos += 1
                return "".join(out)
            if c != "\\":
                out.append(c)
                self.pos += 1
                continue
            esc = text[self.pos + 1] if self.pos + 1 < len(text) else ""
            if esc in _SIMPLE_ESCAPES:
                out.append(_SIMPLE_ESCAPES[esc])
                self.pos += 2
                continue
            digits = text[self.pos + 2 : self.pos + 6]
            if esc != "u" or len(digits) != 4 or any(d not in _HEX for d in digits):
                raise self.fail("invalid escape (use \\\" \\\\ \\n \\t or \\uXXXX)")
            code = int(digits, 16)
            if 0xD800 <= code <= 0xDFFF:
                raise self.fail("\\u escape of a surrogate")
            out.append(chr(code))
            self.pos += 6

    def integer(self) -> int:
        start = self.pos
        if self.peek() == "-":
            self.pos += 1
        digits_start = self.pos
        while self.peek().isascii() and self.peek().isdigit():
            self.pos += 1
        if self.pos == digits_start:
            raise self.fail("expected digits")
        digits = self.text[digits_start : self.pos].lstrip("0")
        if len(digits) > len(str(MAX_INT_ABS)):  # keeps int() under CPython's 4,300-digit limit
            raise GuestError("overflow", f"integer literal beyond ±{MAX_INT_ABS}")
        value = int(digits or "0")
        if value > MAX_INT_ABS:
            raise GuestError("overflow", f"integer literal beyond ±{MAX_INT_ABS}")
        return -value if start != digits_start else value

    def call(self, want: str, depth: int) -> Value:
        start = self.pos
        while "a" <= self.peek() <= "z":
            self.pos += 1
        name = self.text[start : self.pos]
        if name not in _FUNCTIONS:
            self.pos = start
            raise self.fail(f"unknown function '{name[:_NAME_SHOWN]}'")
        params, result = _FUNCTIONS[name]
        if want != _ANY and want != result:
            self.pos = start
            raise self.fail(f"{name} gives {'an integer' if result == _INT else 'a string'}")
        self.expect("(")
        if depth + 1 > MAX_DEPTH:
            raise GuestError("too_large", f"calls nested deeper than {MAX_DEPTH}")
        args: list[Value] = []
        for i, param in enumerate(params):
            if i:
                self.expect(",")
            args.append(self.expr(param, depth + 1))
        self.expect(")")
        return self.apply(name, args)

    def apply(self, name: str, args: list[Value]) -> Value:
        s = args[0]
        assert isinstance(s, str)
        if name == "len":
            return len(s)
        if name == "count":
            assert isinstance(args[1], str)
            return s.count(args[1])  # non-overlapping; len(s) + 1 for ""
        if name == "index":
            assert isinstance(args[1], str)
            return s.find(args[1])
        if name == "reverse":
            return self.new_string(s[::-1])
        if name == "upper":
            return self.new_string("".join(chr(LOWER_TO_UPPER.get(ord(c), ord(c))) for c in s))
        if name == "lower":
            return self.new_string("".join(chr(UPPER_TO_LOWER.get(ord(c), ord(c))) for c in s))
        if name == "substr":
            start, end = args[1], args[2]
            assert isinstance(start, int) and isinstance(end, int)
            return self.new_string(s[start:end])
        old, new = args[1], args[2]
        assert name == "replace" and isinstance(old, str) and isinstance(new, str)
        size = len(s) + s.count(old) * (len(new) - len(old))
        if size > MAX_STRING:  # decided before building the result
            raise GuestError("too_large", f"result of {size} code points (max {MAX_STRING})")
        return self.new_string(s.replace(old, new))


_OUTPUT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t"}


def quote(value: str) -> str:
    """The canonical literal of a string result: never contains ``<``, ``>`` or a control byte."""
    out = ['"']
    for c in value:
        if c in _OUTPUT_ESCAPES:
            out.append(_OUTPUT_ESCAPES[c])
        elif c in "<>" or ord(c) < 0x20:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    out.append('"')
    return "".join(out)


def evaluate(data: bytes) -> str:
    """Evaluates one ``strop`` span; raises :class:`GuestError` with the guest's code."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GuestError("syntax", f"invalid UTF-8 at byte {exc.start}") from None
    parser = _Parser(text)
    value = parser.expr(_ANY, 0)
    parser.skip_ws()
    if parser.pos != len(text):
        raise parser.fail("unexpected text after the expression")
    out = str(value) if isinstance(value, int) else quote(value)
    if len(out.encode("utf-8")) > MAX_OUTPUT_BYTES:
        raise GuestError("too_large", f"result over {MAX_OUTPUT_BYTES} bytes")
    return out
