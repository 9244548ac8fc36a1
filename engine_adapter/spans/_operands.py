"""Operands from the context: an evaluator's literal rules narrowed to the literals of a text.

A small model sets a span up wrongly far more often than the evaluator computes wrongly: it
writes numbers that are not in the question (the instructions' own ``17 * 23 + 91``), or stops
a number early (``3`` for ``38``: it spells numbers digit by digit and the grammar let it stop).
The grammar already decides *how* a span may be written; with this option it also decides what
it may be written *from*. An evaluator's manifest declares which rules of its input grammar are
literals (``"literals": {"number": "number"}``, docs/abi.md); for a request, each such rule is
replaced by the alternatives of the literals found in a text (by default the user's message),
so ``number ::= ("0" | [1-9] …)`` becomes ``number ::= "38" | "27" | "61"``. Everything else
(operators, parentheses, functions) stays the evaluator's own grammar, and after ``3`` only
``8`` may follow: the narrowed rule allows complete literals of the text, nothing shorter.

How literals are found, by the kind the manifest declares (:data:`evald.contract.LITERAL_KINDS`):

- ``number``: numerals as written (``38``, ``1,250`` → ``1250``, ``2.50`` → ``2.50`` and ``2.5``,
  ``-4`` → ``-4`` and ``4``, leading zeros also dropped: ``07`` → ``7``) and English cardinal
  number words, written in digits (``twelve`` → ``12``, ``thirty-eight`` → ``38``, ``two hundred
  and five`` → ``205``, ``a dozen`` → ``12``). Not mapped: ordinals, fractions and multiples
  in words (``third``, ``half``, ``twice``), decimals in words, a numeral with a scale word
  (``2 million``).
- ``string``: words (runs of letters and digits, also joined by an apostrophe or hyphen, and
  each part of such a word), their lower-case forms, and phrases in quotes; each as a
  double-quoted string with JSON escapes (``"strawberry"``).
- ``token``: whitespace-separated pieces of the text as written, stripped of surrounding
  punctuation (``2024-07-04``, ``978-0-306-40615-7``).

Every candidate is kept only if the evaluator's own rule accepts it (XGrammar, with the rule as
the root), so the narrowed language is a subset of the evaluator's: a 20-digit number in the
text does not become a ``calc`` operand its grammar bounds at 12 digits. Each narrowed rule keeps
at least one literal, so the narrowed grammar can always be satisfied; a literal rule for which
the text holds nothing keeps its own language, and an evaluator none of whose literal rules has
a literal in the text is not narrowed at all. The :class:`OperandNarrowing` says which and why.

The work per request is bounded, whatever the text and the manifest (16 literal rules with long
names and a 230 KB text of 40,000 numbers once took 7.3 s to lower one request): literals are
read from the first :data:`MAX_OPERAND_TEXT_CHARS` characters of the text only (cut at the last
whitespace before the bound, so no literal is cut in two); each rule checks at most
:data:`MAX_CANDIDATES_PER_RULE` candidates, in order, and keeps at most
:data:`MAX_LITERALS_PER_RULE`; the candidates of a kind are found once per text, however many
rules and evaluators read them; the rules are at most the manifest's
:data:`~evald.contract.MAX_LITERAL_RULES`. Past a bound the option does not fail: it narrows to
what it read, and :attr:`EvaluatorOperands.bounded` says which bound cut it short.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from evald.contract import LITERAL_KINDS

__all__ = [
    "MAX_CANDIDATES_PER_RULE",
    "MAX_LITERALS_PER_RULE",
    "MAX_OPERAND_TEXT_CHARS",
    "EvaluatorOperands",
    "OperandNarrowing",
    "bounded_text",
    "literals_in_text",
    "narrow_grammar",
]

#: At most this many literals per narrowed rule (the first found in the text): the grammar's
#: compile time grows with its alternatives.
MAX_LITERALS_PER_RULE = 128
#: Literals are read from at most this many characters of the text (its beginning).
MAX_OPERAND_TEXT_CHARS = 16_384
#: At most this many candidates of the text are checked against one rule (each check runs
#: XGrammar's matcher); candidates past it are not offered.
MAX_CANDIDATES_PER_RULE = 512

_RULE_START = re.compile(r"^[ \t]*([A-Za-z_][A-Za-z0-9_-]*)[ \t]*::=", re.MULTILINE)


@dataclass(frozen=True)
class EvaluatorOperands:
    """What the option did to one evaluator's grammar."""

    evaluator: str
    literals: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Rule → the literals it was narrowed to; empty when the grammar was left as it is."""
    reason: str = ""
    """Why the grammar (or some of its literal rules) was left as it is; empty otherwise."""
    declared: bool = True
    """Whether the evaluator's manifest declares literals at all."""
    bounded: str = ""
    """Which bound on the work per request cut the reading short (the text's length, the
    candidates checked per rule); empty when the whole text was read."""
    checked: int = 0
    """Candidates checked against the evaluator's rules (the work this request cost)."""

    @property
    def narrowed(self) -> bool:
        """Whether any of this evaluator's rules was narrowed."""
        return bool(self.literals)


@dataclass(frozen=True)
class OperandNarrowing:
    """What the operands option did for one request: per evaluator, the literals each rule was
    narrowed to, or why it was left as it is."""

    evaluators: tuple[EvaluatorOperands, ...]

    @property
    def applied(self) -> bool:
        """Whether the option narrowed anything; when false, :attr:`reason` says why."""
        return any(e.narrowed for e in self.evaluators)

    @property
    def reason(self) -> str:
        """Why the option is off for the request (empty when it narrowed something)."""
        if self.applied:
            return ""
        if not self.evaluators:
            return "no evaluators"
        return "; ".join(f"{e.evaluator}: {e.reason}" for e in self.evaluators)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"applied", "reason", "evaluators": {name: {"literals", "reason",
        "declared"}}}``."""
        return {
            "applied": self.applied,
            "reason": self.reason,
            "evaluators": {
                e.evaluator: {
                    "literals": {rule: list(lits) for rule, lits in e.literals.items()},
                    "reason": e.reason,
                    "declared": e.declared,
                    "bounded": e.bounded,
                }
                for e in self.evaluators
            },
        }


# -- literals in text ----------------------------------------------------------------------


def literals_in_text(kind: str, text: str) -> list[str]:
    """The literal candidates of one kind in ``text``, in order of appearance, once each, as the
    span would write them (see the module doc). Not yet checked against any rule.

    Raises:
        ValueError: an unknown kind.
    """
    if kind == "number":
        found = _numbers(text)
    elif kind == "string":
        found = [_string_literal(s) for s in _strings(text)]
    elif kind == "token":
        found = _tokens(text)
    else:
        raise ValueError(f"unknown literal kind {kind!r}; choose from {', '.join(LITERAL_KINDS)}")
    return list(dict.fromkeys(s for s in found if s))


@functools.lru_cache(maxsize=16)
def _candidates(kind: str, text: str) -> tuple[str, ...]:
    """:func:`literals_in_text`, found once per text and kind for all the rules reading it."""
    return tuple(literals_in_text(kind, text))


def bounded_text(text: str) -> tuple[str, bool]:
    """The part of ``text`` literals are read from, and whether it was cut: at most
    :data:`MAX_OPERAND_TEXT_CHARS` characters, cut at the last whitespace before the bound (a
    literal is read whole or not at all)."""
    if len(text) <= MAX_OPERAND_TEXT_CHARS:
        return text, False
    head = text[: MAX_OPERAND_TEXT_CHARS + 1]
    cut = max(head.rfind(space) for space in " \t\n\r")
    return (head[:cut] if cut > 0 else head[:MAX_OPERAND_TEXT_CHARS]), True


# A numeral: not inside a word or after a decimal point; thousands separators only in groups of
# three; a sign only where it cannot be a hyphen or a minus between two numbers.
_NUMERAL = re.compile(r"(?<![\w.])(?:(?<![\w)])([-\u2212]))?(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?")
_SMALL = {
    word: value
    for value, word in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen "
        "fourteen fifteen sixteen seventeen eighteen nineteen".split()
    )
}
_TENS = {
    word: 10 * (i + 2)
    for i, word in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())
}
_SCALES = {"thousand": 1000, "million": 10**6, "billion": 10**9}
_WORD = re.compile(r"[a-z]+")


def _numbers(text: str) -> list[str]:
    found: list[tuple[int, list[str]]] = []
    for match in _NUMERAL.finditer(text):
        sign, whole, fraction = match.group(1), match.group(2), match.group(3) or ""
        digits = whole.replace(",", "")
        trimmed = fraction.rstrip("0").rstrip(".")
        forms = [digits + fraction, str(int(digits)) + fraction, str(int(digits)) + trimmed]
        if sign:
            forms = [f"-{form}" for form in forms] + forms
        found.append((match.start(), forms))
    found.extend((start, [str(value)]) for start, value in _number_words(text))
    return [form for _, forms in sorted(found, key=lambda item: item[0]) for form in forms]


def _number_words(text: str) -> list[tuple[int, int]]:
    """``(position, value)`` of each English cardinal number in words.

    Words join a number only when a space or hyphen separates them, and a number ends where the
    next word would not continue it read aloud: ``nineteen eighty-four`` is 19 and 84, ``two
    hundred and five`` is 205; ``a`` counts before ``hundred``, ``dozen`` and the scales, ``and``
    after ``hundred`` or a scale.
    """
    lowered = text.lower()
    words = list(_WORD.finditer(lowered))
    reader = _NumberReader()
    for i, match in enumerate(words):
        joined = i > 0 and lowered[words[i - 1].end() : match.start()] in (" ", "-")
        if not joined:
            reader.flush()
        following = words[i + 1] if i + 1 < len(words) else None
        then = (
            _word_kind(following.group())
            if following is not None and lowered[match.end() : following.start()] in (" ", "-")
            else None
        )
        kind = _word_kind(match.group())
        if kind is not None:
            reader.add(kind[0], kind[1], match.start())
        elif match.group() in ("a", "an") and then is not None and then[0] in _MULTIPLIERS:
            reader.flush()
            reader.start = match.start()
        elif match.group() == "and" and reader.last in ("hundred", "scale") and then is not None:
            reader.last = "and"
        else:
            reader.flush()
    reader.flush()
    return reader.found


_MULTIPLIERS = ("hundred", "dozen", "scale")


class _NumberReader:
    """Reads number words one at a time (:func:`_number_words`)."""

    def __init__(self) -> None:
        self.found: list[tuple[int, int]] = []
        self.start = -1
        self.total = self.current = 0
        self.last = ""  # the previous word's kind; "" before a number starts

    def flush(self) -> None:
        if self.last:
            self.found.append((self.start, self.total + self.current))
        self.start, self.total, self.current, self.last = -1, 0, 0, ""

    def add(self, kind: str, value: int, at: int) -> None:
        if self.last and not _continues(self.last, kind):
            self.flush()
        if self.start < 0:
            self.start = at
        if kind in ("small", "teen", "tens"):
            self.current += value
        elif kind in ("hundred", "dozen"):
            self.current = (self.current or 1) * value
        else:
            self.total += (self.current or 1) * value
            self.current = 0
        self.last = kind


def _word_kind(word: str) -> tuple[str, int] | None:
    if word in _SMALL:
        value = _SMALL[word]
        return ("small" if value < 10 else "teen"), value
    if word in _TENS:
        return "tens", _TENS[word]
    if word == "hundred":
        return "hundred", 100
    if word == "dozen":
        return "dozen", 12
    if word in _SCALES:
        return "scale", _SCALES[word]
    return None


def _continues(last: str, kind: str) -> bool:
    """Whether a number word of ``kind`` continues a number whose last word was ``last``
    (nothing continues ``dozen``: ``two dozen and five`` is 24 and 5)."""
    if kind in ("hundred", "dozen"):
        return last in ("small", "teen", "tens", "")
    if kind == "scale":
        return last in ("small", "teen", "tens", "hundred")
    if kind == "small":
        return last in ("tens", "hundred", "scale", "and")
    return last in ("hundred", "scale", "and")  # a teen or a tens word


_WORD_RUN = re.compile(r"[^\W_]+(?:['\u2019-][^\W_]+)*")
_QUOTED = re.compile(
    r'"([^"\n]+)"|\u201c([^\u201d\n]+)\u201d|(?<!\w)\'([^\'\n]+)\'(?!\w)'
    r"|(?<!\w)\u2018([^\u2019\n]+)\u2019(?!\w)"
)


def _strings(text: str) -> list[str]:
    found: list[tuple[int, str]] = []
    for match in _QUOTED.finditer(text):
        phrase = next(group for group in match.groups() if group is not None)
        found.append((match.start(), phrase))
    for match in _WORD_RUN.finditer(text):
        word = match.group()
        parts = [word, *re.split(r"['\u2019-]", word)] if len(word) > 1 else [word]
        for part in parts:
            found.append((match.start(), part))
            if part.lower() != part:
                found.append((match.start(), part.lower()))
    return [s for _, s in sorted(found, key=lambda item: item[0])]


def _string_literal(value: str) -> str:
    """A double-quoted string with JSON escapes; ``<`` escaped too (no span may produce it)."""
    return json.dumps(value, ensure_ascii=False).replace("<", "\\u003c")


_EDGE_PUNCTUATION = ".,;:!?()[]{}\"'\u201c\u201d\u2018\u2019"


def _tokens(text: str) -> list[str]:
    return [piece.strip(_EDGE_PUNCTUATION) for piece in text.split()]


# -- the grammar ---------------------------------------------------------------------------


def narrow_grammar(
    input_grammar: str, literal_rules: Mapping[str, str], text: str, evaluator: str = ""
) -> tuple[str | None, EvaluatorOperands]:
    """One evaluator's input grammar with its literal rules narrowed to the literals of ``text``.

    Parameters:
        input_grammar: the evaluator's XGrammar EBNF (root rule ``root``).
        literal_rules: rule → kind, from the manifest's ``literals``.
        text: where the literals come from (by default the request's user message).
        evaluator: the evaluator's name, for the report.

    Returns:
        ``(grammar, report)``: the narrowed EBNF, or ``None`` when nothing was narrowed (the
        report says why; the evaluator's own grammar then applies).

    Raises:
        ImportError: XGrammar is not installed (it checks each literal against its rule).
    """
    if not literal_rules:
        return None, EvaluatorOperands(
            evaluator, reason="its manifest declares no literals", declared=False
        )
    defined = {match.group(1) for match in _RULE_START.finditer(input_grammar)}
    missing = [rule for rule in literal_rules if rule not in defined]
    if missing:  # a request replaced the evaluator's grammar with one of its own
        return None, EvaluatorOperands(
            evaluator, reason=f"its grammar has no rule {', '.join(missing)}"
        )
    text, cut = bounded_text(text)
    bounds = [f"literals read from the first {len(text)} characters of the text"] if cut else []
    found: dict[str, tuple[str, ...]] = {}
    checked = 0
    for rule, kind in literal_rules.items():
        accepts = _rule_language(input_grammar, rule)
        candidates = _candidates(kind, text)
        kept: list[str] = []
        for literal in candidates[:MAX_CANDIDATES_PER_RULE]:
            checked += 1
            if accepts(literal):
                kept.append(literal)
                if len(kept) == MAX_LITERALS_PER_RULE:
                    break
        else:
            if len(candidates) > MAX_CANDIDATES_PER_RULE:
                bounds.append(f"{rule}: the first {MAX_CANDIDATES_PER_RULE} candidates checked")
        if kept:
            found[rule] = tuple(kept)
    bounded = "; ".join(bounds)
    if not found:
        wanted = ", ".join(f"a {kind} for {rule}" for rule, kind in literal_rules.items())
        return None, EvaluatorOperands(
            evaluator,
            reason=f"the text holds no literal its grammar accepts ({wanted})",
            bounded=bounded,
            checked=checked,
        )
    narrowed = input_grammar
    for rule, literals in found.items():
        narrowed = _replace_rule(narrowed, rule, " | ".join(map(_ebnf_literal, literals)))
    left = [rule for rule in literal_rules if rule not in found]
    reason = (
        f"{', '.join(left)} left as {'it is' if len(left) == 1 else 'they are'}: the text "
        "holds no literal for it"
        if left
        else ""
    )
    return narrowed, EvaluatorOperands(evaluator, found, reason, bounded=bounded, checked=checked)


def _replace_rule(grammar: str, rule: str, body: str) -> str:
    """``grammar`` with the definition of ``rule`` (up to the next rule) replaced by ``body``."""
    starts = list(_RULE_START.finditer(grammar))
    for i, match in enumerate(starts):
        if match.group(1) == rule:
            end = starts[i + 1].start() if i + 1 < len(starts) else len(grammar)
            tail = grammar[end:]
            return f"{grammar[: match.start()]}{rule} ::= {body}\n{tail}"
    raise ValueError(f"the grammar defines no rule {rule!r}")


def _ebnf_literal(value: str) -> str:
    """An EBNF string for ``value``. Each non-ASCII character is a literal of its own: XGrammar
    0.2.7 misreads one followed by a hex digit when it re-reads a cached grammar (``"°C"``)."""
    pieces = re.findall(r"[\x00-\x7f]+|[^\x00-\x7f]", value)
    rendered = [json.dumps(piece) if piece.isascii() else f'"{piece}"' for piece in pieces]
    return rendered[0] if len(rendered) == 1 else f"({' '.join(rendered)})"


@functools.lru_cache(maxsize=64)
def _compiled_rule(grammar: str, rule: str) -> Any:
    try:
        import xgrammar as xgr
    except ImportError as exc:  # pragma: no cover - the engine extra installs it
        raise ImportError(
            "the operands option checks each literal against the evaluator's own rule with "
            "XGrammar: pip install 'evald[engine]'"
        ) from exc
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1, cache_enabled=False)
    return compiler.compile_grammar(xgr.Grammar.from_ebnf(grammar, root_rule_name=rule))


def _rule_language(grammar: str, rule: str) -> Callable[[str], bool]:
    """Whether a string is in the language of ``rule`` of ``grammar`` (a fresh matcher)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(_compiled_rule(grammar, rule), terminate_without_stop_token=True)

    def accepts(value: str) -> bool:
        matcher.reset()
        return bool(matcher.accept_string(value)) and bool(matcher.is_terminated())

    return accepts
