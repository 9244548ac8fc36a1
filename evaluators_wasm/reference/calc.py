"""Reference implementation of ``calc/1`` (docs/semantics/calc.md).

Two phases, exactly like the WASM guest (``evaluators_wasm/src/calc/main.zig``):

1. *Parse*: one left-to-right pass, an operator-precedence (shunting-yard) parser with explicit
   stacks, that turns the input into postfix order. Every ``syntax`` and ``too_large`` error is
   found here, and the first one met reading left to right is the one reported. No arithmetic
   happens yet, so an input with a syntax error never spends time on big numbers.
2. *Evaluate* the postfix program with a value stack: operands left to right, each operator as soon
   as its operands are ready. The first ``division_by_zero``, ``overflow`` or ``domain`` error in
   that order is the one reported.

Both phases are iterative (no recursion), so deep inputs cannot exhaust Python's stack; depth is
still bounded (``MAX_DEPTH``) because the guest's stack, memory and fuel are.
"""

from __future__ import annotations

import re
from fractions import Fraction

from evaluators_wasm.reference import GuestError

__all__ = [
    "MAX_BITS",
    "MAX_DEPTH",
    "MAX_LITERAL_DIGITS",
    "MAX_RESULT_EXPONENT",
    "SIGNIFICANT_DIGITS",
    "evaluate",
]

MAX_LITERAL_DIGITS = 1000
"""Digits in one number literal, before and after the point, leading zeros included."""
MAX_DEPTH = 256
"""Nesting levels: each open parenthesis, unary sign and right operand of ``**`` adds one."""
MAX_BITS = 16384
"""Bit length bound of the numerator and of the denominator of every value (lowest terms)."""
MAX_RESULT_EXPONENT = 4300
"""The printed result must satisfy 10**-4300 <= |value| < 10**4300 (or be zero)."""
SIGNIFICANT_DIGITS = 28
"""Non-integer results are rounded half-even to this many significant digits."""

# One token after optional whitespace: a number (group 1: digits, 2: the point, 3: digits after
# it), an operator or parenthesis (group 4), or nothing (the byte at the match's end is invalid).
_TOKEN = re.compile(rb"[ \t\n\r]*(?:(?=[0-9.])([0-9]*)(?:(\.)([0-9]*))?|(\*\*|[-+*/%()]))?")

# Operators on the parser's stack. Binary ones by their text; unary signs and the group marker
# get names that cannot clash.
_NEG, _POS, _OPEN = "neg", "pos", "("
_PREFIX = {b"-": _NEG, b"+": _POS, b"(": _OPEN}
_BINARY = {b"+": "+", b"-": "-", b"*": "*", b"/": "/", b"%": "%", b"**": "**"}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "%": 2, _NEG: 3, _POS: 3, "**": 4}
# Operators that open a nesting level (counted against MAX_DEPTH while on the stack).
_NESTING = frozenset({_OPEN, _NEG, _POS, "**"})

# Values are ints while they are integers (faster than Fraction); both have .numerator and
# .denominator, which is all the checks and the formatting look at.
_Value = int | Fraction
_Item = _Value | str


def evaluate(data: bytes) -> str:
    """Evaluates one ``calc`` expression and returns its canonical value.

    Raises:
        GuestError: with code ``syntax``, ``too_large``, ``division_by_zero``, ``overflow`` or
            ``domain`` (see docs/semantics/calc.md for when each applies).
    """
    return _format(_run(_parse(data)))


# --- phase 1: parse -------------------------------------------------------------------------------


def _describe(data: bytes, pos: int) -> str:
    if pos >= len(data):
        return "end of input"
    char = data[pos]
    if 0x21 <= char <= 0x7E:
        return f"'{chr(char)}' at offset {pos}"
    return f"byte 0x{char:02x} at offset {pos}"


def _parse(data: bytes) -> list[_Item]:
    """Returns the expression in postfix order (numbers as values, operators as strings)."""
    out: list[_Item] = []
    ops: list[str] = []
    depth = 0
    expect_operand = True
    pos, end = 0, len(data)
    token = _TOKEN.match
    while True:
        m = token(data, pos)
        assert m is not None  # every part of the pattern is optional
        whole, point, fraction, symbol = m.groups()
        pos = m.end()
        if expect_operand:
            if whole is not None:
                out.append(_literal(m.start(1), whole, point, fraction))
                expect_operand = False
            elif symbol in _PREFIX:
                depth += 1
                if depth > MAX_DEPTH:
                    raise _too_deep(m.start(4))
                ops.append(_PREFIX[symbol])
            else:
                at = pos if symbol is None else m.start(4)
                raise GuestError(
                    "syntax", f"expected a number, '(' or a sign; found {_describe(data, at)}"
                )
            continue
        if symbol is None or whole is not None:
            at = pos if whole is None else m.start(1)
            if at < end:
                raise GuestError(
                    "syntax", f"expected an operator or ')'; found {_describe(data, at)}"
                )
            while ops:  # end of input
                op = ops.pop()
                if op == _OPEN:
                    raise GuestError("syntax", "missing ')' at end of input")
                out.append(op)
            return out
        if symbol == b")":
            while ops and ops[-1] != _OPEN:
                op = ops.pop()
                depth -= op in _NESTING
                out.append(op)
            if not ops:
                raise GuestError("syntax", f"unmatched ')' at offset {m.start(4)}")
            ops.pop()
            depth -= 1
            continue
        if symbol in _PREFIX and symbol != b"-" and symbol != b"+":  # "(" after an operand
            raise GuestError(
                "syntax", f"expected an operator or ')'; found {_describe(data, m.start(4))}"
            )
        op = _BINARY[symbol]
        precedence = _PRECEDENCE[op]
        while ops and ops[-1] != _OPEN:
            top = _PRECEDENCE[ops[-1]]
            if top > precedence or (top == precedence and op != "**"):
                popped = ops.pop()
                depth -= popped in _NESTING
                out.append(popped)
            else:
                break
        if op == "**":
            depth += 1
            if depth > MAX_DEPTH:
                raise _too_deep(m.start(4))
        ops.append(op)
        expect_operand = True


def _too_deep(at: int) -> GuestError:
    return GuestError("too_large", f"nesting deeper than {MAX_DEPTH} levels at offset {at}")


def _too_many_digits(start: int) -> GuestError:
    return GuestError(
        "too_large", f"number at offset {start} has more than {MAX_LITERAL_DIGITS} digits"
    )


def _literal(start: int, whole: bytes, point: bytes | None, fraction: bytes | None) -> _Value:
    if len(whole) > MAX_LITERAL_DIGITS:
        raise _too_many_digits(start)
    if point is None:
        return int(whole)
    assert fraction is not None
    if not fraction:
        raise GuestError(
            "syntax", f"'.' at offset {start + len(whole)} must be followed by a digit"
        )
    if len(whole) + len(fraction) > MAX_LITERAL_DIGITS:
        raise _too_many_digits(start)
    return Fraction(int(whole + fraction), 10 ** len(fraction))


# --- phase 2: evaluate ----------------------------------------------------------------------------


def _check(value: _Value) -> _Value:
    if value.numerator.bit_length() > MAX_BITS or value.denominator.bit_length() > MAX_BITS:
        raise GuestError("overflow", f"an intermediate value needs more than {MAX_BITS} bits")
    return value


def _power(base: _Value, exponent: _Value) -> _Value:
    if exponent.denominator != 1:
        raise GuestError("domain", "the exponent of ** must be an integer")
    n = exponent.numerator
    if base == 0:
        if n < 0:
            raise GuestError("division_by_zero", "0 raised to a negative power")
        return 1 if n == 0 else 0
    if base == 1 or base == -1:
        return -1 if base == -1 and n % 2 else 1
    # Refuse early what certainly needs more than MAX_BITS: x >= 2**(b-1) for a b-bit x, so x**k
    # needs at least k*(b-1) + 1 bits. Anything else is computed and checked exactly by _check.
    size = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
    if abs(n) * (size - 1) >= MAX_BITS:
        raise GuestError("overflow", f"the power needs more than {MAX_BITS} bits")
    if n < 0:
        return Fraction(base.denominator**-n, base.numerator**-n)
    return base**n


def _run(program: list[_Item]) -> _Value:
    stack: list[_Value] = []
    push = stack.append
    for item in program:
        if type(item) is not str:
            push(item)
            continue
        if item == _NEG:
            stack[-1] = -stack[-1]
            continue
        if item == _POS:
            continue
        b = stack.pop()
        a = stack[-1]
        if item == "+":
            r = a + b
        elif item == "-":
            r = a - b
        elif item == "*":
            r = a * b
        elif item == "**":
            r = _power(a, b)
        elif b == 0:
            raise GuestError("division_by_zero", f"'{item}' by zero")
        elif item == "/":
            if type(a) is int and type(b) is int and a % b == 0:
                r = a // b
            else:
                r = Fraction(a) / b
        else:  # %: floored, the result has the sign of the divisor
            r = a % b
        stack[-1] = _check(r)
    return stack[0]


# --- the canonical text ---------------------------------------------------------------------------

_LOWER_BOUND = 10**MAX_RESULT_EXPONENT
_OUT_OF_RANGE = (
    f"the result is outside 10**-{MAX_RESULT_EXPONENT} <= |x| < 10**{MAX_RESULT_EXPONENT}"
)


def _format(value: _Value) -> str:
    p, q = abs(value.numerator), value.denominator
    sign = "-" if value < 0 else ""
    if q == 1:
        if p >= _LOWER_BOUND:
            raise GuestError("overflow", _OUT_OF_RANGE)
        return sign + str(p)
    # e = floor(log10(p / q)): estimate from bit lengths, then correct exactly.
    e = (p.bit_length() - q.bit_length()) * 30103 // 100000
    while _ge_scaled(p, q, e + 1):
        e += 1
    while not _ge_scaled(p, q, e):
        e -= 1
    # N = p/q * 10**shift rounded half-even, 28 digits.
    shift = SIGNIFICANT_DIGITS - 1 - e
    num, den = (p * 10**shift, q) if shift >= 0 else (p, q * 10 ** (-shift))
    digits, rest = divmod(num, den)
    if 2 * rest > den or (2 * rest == den and digits % 2 == 1):
        digits += 1
        if digits == 10**SIGNIFICANT_DIGITS:
            digits //= 10
            shift -= 1
    exponent = SIGNIFICANT_DIGITS - 1 - shift
    if exponent >= MAX_RESULT_EXPONENT or exponent < -MAX_RESULT_EXPONENT:
        raise GuestError("overflow", _OUT_OF_RANGE)
    while digits % 10 == 0:
        digits //= 10
        shift -= 1
    text = str(digits)
    if shift <= 0:
        return sign + text + "0" * -shift
    if len(text) > shift:
        return f"{sign}{text[:-shift]}.{text[-shift:]}"
    return f"{sign}0.{'0' * (shift - len(text))}{text}"


def _ge_scaled(p: int, q: int, e: int) -> bool:
    """p / q >= 10**e."""
    return p >= q * 10**e if e >= 0 else p * 10 ** (-e) >= q
