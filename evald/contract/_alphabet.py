"""Whether an evaluator's input grammar or result regex can produce a given character.

The ABI forbids ``<`` in both languages (docs/abi.md): a span's content must not be able to spell
its closing tag, and a forced result must not be able to spell ``</result>`` or a chat template's
special tokens (``<|im_end|>``). The daemon enforces it at every load (registration, start-up
reload, ``evald build``) through :func:`check_no_angle_bracket`; this is its one home.

The scan is conservative: a ``True`` may be a false alarm (a negated class used only where the
rest of the grammar rules the character out), never a miss. Constructs it does not understand
(an unknown regex escape such as ``\\p{L}``, an unterminated class or literal) count as able to
produce anything.
"""

from __future__ import annotations

from typing import Final

from evald.contract._errors import ErrorCode, EvaldError

__all__ = ["check_no_angle_bracket", "may_produce"]

_ESCAPES: Final = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "f": "\f", "v": "\v"}
#: Zero-width regex assertions (word boundary and its negation): they produce no character.
_ZERO_WIDTH: Final = frozenset("bB")
_HEX_WIDTH: Final = {"x": 2, "u": 4, "U": 8}
#: Regex escapes whose class holds ``<`` (``\D``, ``\S``, ``\W``) or does not (lower case).
_WIDE_ESCAPES: Final = frozenset("DSW")
_HEX_DIGITS: Final = frozenset("0123456789abcdefABCDEF")
_NARROW_ESCAPES: Final = frozenset("dsw")


class _Unknown(Exception):
    """A construct the scan cannot read: treated as able to produce anything."""


def _read_char(text: str, i: int, *, regex: bool) -> tuple[str, int]:
    """One possibly escaped character at ``text[i]``; returns it and the next index."""
    if text[i] != "\\":
        return text[i], i + 1
    if i + 1 >= len(text):
        raise _Unknown
    kind = text[i + 1]
    width = _HEX_WIDTH.get(kind)
    if width is not None:
        digits = text[i + 2 : i + 2 + width]
        if kind == "x" and digits.startswith("{"):
            raise _Unknown  # \x{...}: a form the scan does not decode
        if len(digits) != width or not all(d in _HEX_DIGITS for d in digits):
            raise _Unknown
        return chr(int(digits, 16)), i + 2 + width
    if kind in _ESCAPES:
        return _ESCAPES[kind], i + 2
    if regex and kind in _ZERO_WIDTH:
        return "\0", i + 2
    if kind.isalnum():
        raise _Unknown  # \p{..}, \N{..}, back-references, octal: could stand for anything
    return kind, i + 2  # an escaped punctuation mark stands for itself


def _class_holds(text: str, i: int, char: str, *, regex: bool) -> tuple[bool, int]:
    """Whether the bracket class starting at ``text[i] == "["`` matches ``char``; next index."""
    i += 1
    negated = i < len(text) and text[i] == "^"
    i += negated
    holds = False
    first = True
    while True:
        if i >= len(text):
            raise _Unknown  # unterminated class
        if text[i] == "]" and not first:
            break
        first = False
        if text[i] == "[":
            raise _Unknown  # nested classes, [[:alpha:]]: not read
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "dswDSW":
            holds |= text[i + 1] in _WIDE_ESCAPES
            i += 2
            continue
        low, i = _read_char(text, i, regex=regex)
        high = low
        if i + 1 < len(text) and text[i] == "-" and text[i + 1] != "]":
            high, i = _read_char(text, i + 1, regex=regex)
        holds |= low <= char <= high
    return holds != negated, i + 1


def _scan(text: str, char: str, *, regex: bool) -> tuple[bool, list[str]]:
    literals: list[str] = []
    produces = False
    i = 0
    while i < len(text):
        c = text[i]
        if not regex and c == "#":  # a comment, to the end of the line
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
        elif not regex and c in "\"'":
            chars, i = [], i + 1
            while i < len(text) and text[i] != c:
                decoded, i = _read_char(text, i, regex=False)
                chars.append(decoded)
            if i >= len(text):
                raise _Unknown  # unterminated literal
            literal = "".join(chars)
            literals.append(literal)
            produces |= char in literal
            i += 1
        elif c == "[":
            holds, i = _class_holds(text, i, char, regex=regex)
            produces |= holds
        elif c == "\\":
            if i + 1 < len(text) and text[i + 1] in _WIDE_ESCAPES:
                produces = True
                i += 2
            elif i + 1 < len(text) and text[i + 1] in _NARROW_ESCAPES:
                i += 2
            else:
                decoded, i = _read_char(text, i, regex=regex)
                produces |= decoded == char
        else:
            # "." is any character in a regex; in EBNF it has no meaning outside a literal, so
            # it is read as the wildcard too rather than trusted.
            produces |= c == char or c == "."
            i += 1
    return produces, literals


def may_produce(text: str, char: str, *, regex: bool) -> tuple[bool, list[str]]:
    """A conservative scan of an EBNF grammar (``regex=False``) or a regex: can it produce
    ``char``? Also returns the EBNF string literals read (for further literal checks).

    A construct the scan cannot read counts as producing ``char``.
    """
    try:
        return _scan(text, char, regex=regex)
    except _Unknown:
        return True, []


def check_no_angle_bracket(input_grammar: str, result_regex: str) -> None:
    """Refuses a manifest whose input grammar or result regex may produce ``<`` (ABI rule).

    Raises:
        EvaldError: ``INVALID_MODULE`` naming the field and the usual fix.
    """
    if may_produce(input_grammar, "<", regex=False)[0]:
        raise EvaldError(
            ErrorCode.INVALID_MODULE,
            "manifest field input_grammar may produce '<' (a literal with '<', a class such as "
            "[^a] that does not exclude it, or a construct the check cannot read); the ABI "
            "forbids it, since the span's closing tag would be ambiguous: exclude it, e.g. "
            "[^<\\n]",
        )
    if may_produce(result_regex, "<", regex=True)[0]:
        raise EvaldError(
            ErrorCode.INVALID_MODULE,
            "manifest field result_regex may produce '<' ('.', \\S, \\W, \\D, a class that "
            "does not exclude it, or a construct the check cannot read); the ABI forbids it, "
            "since a forced value could spell </result> or a chat special token: exclude it, "
            "e.g. [^<\\n]*",
        )
