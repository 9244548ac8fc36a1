"""The shape every input grammar and result regex must have: nesting no deeper than
:data:`MAX_GRAMMAR_NESTING`.

Why a bound in the contract: the daemon parses a manifest without XGrammar (it is not a daemon
dependency), while ``evald build`` and the engine adapter compile the grammar with it, and
XGrammar refuses a grammar nested about 1,000 deep ("Nest layer exceeded the maximum limit").
Without one check both apply, the daemon accepted a grammar nested 1,500 deep that ``evald build``
refused, and every request naming it then failed in the adapter with an untyped XGrammar error.
So :func:`parse_manifest` (which the daemon, ``evald build`` and clients all call) refuses
deeper nesting with ``invalid_module``; the size is bounded by the manifest's own
:data:`~evald.contract.MANIFEST_MAX_BYTES`. The bound sits well inside XGrammar's, so whatever
passes here is never refused there for its depth.

The scan reads only what opens and closes a group: ``(`` and ``)`` outside quoted strings,
character classes and comments (EBNF), and outside classes and escapes (regex).
"""

from __future__ import annotations

from typing import Final

from evald.contract._errors import ErrorCode, EvaldError

__all__ = ["MAX_GRAMMAR_NESTING", "check_grammar_shape", "nesting_depth"]

#: The deepest nesting of groups a manifest's grammar or regex may have (XGrammar's own limit
#: is about 1,000 for a grammar, less for a regex, which it rewrites into a grammar).
MAX_GRAMMAR_NESTING: Final = 256


def _skip_class(text: str, i: int) -> int:
    """The index after the character class opening at ``text[i]`` (``[``)."""
    i += 1
    if i < len(text) and text[i] == "^":
        i += 1
    if i < len(text) and text[i] == "]":  # a leading ] is a member
        i += 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _skip_string(text: str, i: int) -> int:
    """The index after the quoted string opening at ``text[i]`` (``"`` or ``'``)."""
    quote = text[i]
    i += 1
    while i < len(text) and text[i] != quote:
        if text[i] == "\n":
            return i
        i += 2 if text[i] == "\\" else 1
    return i + 1


def nesting_depth(text: str, *, regex: bool) -> int:
    """The deepest nesting of ``( … )`` groups in an EBNF grammar or a regex."""
    depth = deepest = 0
    i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i = _skip_class(text, i)
            continue
        if not regex:
            if c in "\"'":
                i = _skip_string(text, i)
                continue
            if c == "#":
                end = text.find("\n", i)
                i = n if end < 0 else end
                continue
        if c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(0, depth - 1)
        i += 1
    return deepest


def check_grammar_shape(input_grammar: str, result_regex: str) -> None:
    """Refuses a grammar or regex nested deeper than :data:`MAX_GRAMMAR_NESTING`.

    Raises:
        EvaldError: ``invalid_module`` naming the field, its depth and the bound.
    """
    for field, text, regex in (
        ("input_grammar", input_grammar, False),
        ("result_regex", result_regex, True),
    ):
        depth = nesting_depth(text, regex=regex)
        if depth > MAX_GRAMMAR_NESTING:
            raise EvaldError(
                ErrorCode.INVALID_MODULE,
                f"manifest field {field} nests groups {depth} deep; at most "
                f"{MAX_GRAMMAR_NESTING} are allowed (split the nesting into named rules)",
            )
