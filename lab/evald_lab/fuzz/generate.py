"""Grammar-aware generation and mutation of evaluator inputs, driven by a seeded ``random.Random``.

Every evaluator publishes the language of its spans (``EvaluatorInfo.input_grammar``, XGrammar
EBNF). :class:`GrammarGenerator` reads that EBNF and produces random sentences of it, so inputs
are valid-looking for any evaluator, a tenant's own included, with no per-evaluator code.
:func:`mutate` then damages them the way attackers and broken models do: byte flips, invalid
UTF-8, NUL and control bytes, duplicated or deleted ranges (deeper nesting, longer numbers),
splices of two inputs, huge literals.

Why not hypothesis strategies: a fuzz run draws a million inputs, and hypothesis' engine
(shrinking, example database, health checks) costs milliseconds per example; a plain
``random.Random`` costs microseconds and replays exactly from ``--seed``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = [
    "INTERESTING_BYTES",
    "GrammarError",
    "GrammarGenerator",
    "mutate",
    "parse_ebnf",
]


class GrammarError(ValueError):
    """The EBNF uses something this reader does not understand."""


# Grammar tree ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Lit:
    text: str


@dataclass(frozen=True)
class _Class:
    negated: bool
    ranges: tuple[tuple[int, int], ...]

    @property
    def cumulative(self) -> list[int]:
        """Cumulative range sizes (for weighted sampling)."""
        total = 0
        out = []
        for low, high in self.ranges:
            total += high - low + 1
            out.append(total)
        return out

    def contains(self, code: int) -> bool:
        inside = any(low <= code <= high for low, high in self.ranges)
        return inside != self.negated


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Seq:
    items: tuple[_Node, ...]


@dataclass(frozen=True)
class _Alt:
    options: tuple[_Node, ...]


@dataclass(frozen=True)
class _Repeat:
    item: _Node
    minimum: int
    maximum: int | None


_Node = _Lit | _Class | _Ref | _Seq | _Alt | _Repeat

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "]": "]", "-": "-", "[": "["}


class _Parser:
    """Recursive descent over the XGrammar EBNF subset the evaluators use."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, message: str) -> GrammarError:
        return GrammarError(f"{message} at offset {self.pos}")

    def skip(self, newlines: bool = True) -> None:
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "#":
                while self.pos < len(self.text) and self.text[self.pos] != "\n":
                    self.pos += 1
            elif char in " \t\r" or (newlines and char == "\n"):
                self.pos += 1
            else:
                break

    def at_rule_start(self) -> bool:
        """Whether the next tokens are ``name ::=`` (a new rule, which ends the current one)."""
        save = self.pos
        self.skip()
        start = self.pos
        while self.pos < len(self.text) and (
            self.text[self.pos].isalnum() or self.text[self.pos] in "_-"
        ):
            self.pos += 1
        found = self.pos > start
        self.skip(newlines=False)
        found = found and self.text.startswith("::=", self.pos)
        self.pos = save
        return found

    def rules(self) -> dict[str, _Node]:
        rules: dict[str, _Node] = {}
        self.skip()
        while self.pos < len(self.text):
            name = self.identifier()
            self.skip(newlines=False)
            if not self.text.startswith("::=", self.pos):
                raise self.error(f"expected ::= after {name!r}")
            self.pos += 3
            rules[name] = self.alternatives()
            self.skip()
        if "root" not in rules:
            raise GrammarError("the grammar has no root rule")
        return rules

    def identifier(self) -> str:
        start = self.pos
        while self.pos < len(self.text) and (
            self.text[self.pos].isalnum() or self.text[self.pos] in "_-"
        ):
            self.pos += 1
        if self.pos == start:
            raise self.error("expected a rule name")
        return self.text[start : self.pos]

    def alternatives(self) -> _Node:
        options = [self.sequence()]
        while True:
            self.skip()
            if self.pos < len(self.text) and self.text[self.pos] == "|":
                self.pos += 1
                options.append(self.sequence())
            else:
                break
        return options[0] if len(options) == 1 else _Alt(tuple(options))

    def sequence(self) -> _Node:
        items: list[_Node] = []
        while True:
            self.skip()
            if self.pos >= len(self.text) or self.text[self.pos] in "|)":
                break
            if self.at_rule_start():
                break
            items.append(self.postfix(self.atom()))
        if not items:
            return _Lit("")
        return items[0] if len(items) == 1 else _Seq(tuple(items))

    def postfix(self, node: _Node) -> _Node:
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "?":
                node = _Repeat(node, 0, 1)
            elif char == "*":
                node = _Repeat(node, 0, None)
            elif char == "+":
                node = _Repeat(node, 1, None)
            elif char == "{":
                end = self.text.find("}", self.pos)
                if end < 0:
                    raise self.error("unclosed {")
                body = self.text[self.pos + 1 : end]
                low_text, comma, high_text = body.partition(",")
                try:
                    low = int(low_text.strip() or 0)
                    high = (
                        int(high_text) if comma and high_text.strip() else (None if comma else low)
                    )
                except ValueError:
                    raise self.error(f"bad repetition {{{body}}}") from None
                node = _Repeat(node, low, high)
                self.pos = end
            else:
                break
            self.pos += 1
        return node

    def atom(self) -> _Node:
        char = self.text[self.pos]
        if char == '"':
            return _Lit(self.string())
        if char == "[":
            return self.char_class()
        if char == "(":
            self.pos += 1
            node = self.alternatives()
            self.skip()
            if self.pos >= len(self.text) or self.text[self.pos] != ")":
                raise self.error("expected )")
            self.pos += 1
            return node
        return _Ref(self.identifier())

    def escape(self) -> str:
        self.pos += 1  # the backslash
        char = self.text[self.pos]
        if char in "uxU":
            width = {"x": 2, "u": 4, "U": 8}[char]
            digits = self.text[self.pos + 1 : self.pos + 1 + width]
            self.pos += 1 + width
            return chr(int(digits, 16))
        self.pos += 1
        return _ESCAPES.get(char, char)

    def string(self) -> str:
        self.pos += 1
        out: list[str] = []
        while self.pos < len(self.text) and self.text[self.pos] != '"':
            if self.text[self.pos] == "\\":
                out.append(self.escape())
            else:
                out.append(self.text[self.pos])
                self.pos += 1
        if self.pos >= len(self.text):
            raise self.error("unclosed string")
        self.pos += 1
        return "".join(out)

    def char_class(self) -> _Class:
        self.pos += 1
        negated = self.text.startswith("^", self.pos)
        if negated:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        while self.pos < len(self.text) and self.text[self.pos] != "]":
            low = self.class_char()
            if (
                self.text.startswith("-", self.pos)
                and self.text[self.pos + 1 : self.pos + 2] != "]"
            ):
                self.pos += 1
                high = self.class_char()
            else:
                high = low
            ranges.append((ord(low), ord(high)))
        if self.pos >= len(self.text):
            raise self.error("unclosed [")
        self.pos += 1
        return _Class(negated, tuple(ranges))

    def class_char(self) -> str:
        if self.text[self.pos] == "\\":
            return self.escape()
        char = self.text[self.pos]
        self.pos += 1
        return char


def parse_ebnf(text: str) -> dict[str, _Node]:
    """The rules of an XGrammar EBNF grammar (``root`` included).

    Raises:
        GrammarError: syntax this reader does not understand, or no ``root`` rule.
    """
    try:
        return _Parser(text).rules()
    except IndexError:
        raise GrammarError("the grammar ends in the middle of an expression") from None


# Generation -----------------------------------------------------------------------------------

#: Characters tried for a negated class (``[^"\\<\n]``): ASCII, accents, CJK, emoji, specials.
_NEGATED_POOL = [chr(code) for code in range(0x20, 0x7F)] + list(
    "éüßñçøΩλЖ中文字😀👍🏽\u0301\u200b\u202e\ufeff\u00a0\t"
)


class GrammarGenerator:
    """Random sentences of one grammar. Deterministic for a given ``random.Random`` state.

    Parameters:
        grammar: XGrammar EBNF with a ``root`` rule.
        max_depth: past this many nested rule expansions, choose the cheapest alternative and
            the fewest repetitions, so generation always ends.
        mean_repeat: the mean count of an unbounded repetition (``*``, ``+``).

    Raises:
        GrammarError: the grammar cannot be read, or a rule refers to one that does not exist.
    """

    def __init__(self, grammar: str, *, max_depth: int = 8, mean_repeat: float = 2.0) -> None:
        self.rules = parse_ebnf(grammar)
        self.max_depth = max_depth
        self._continue = mean_repeat / (mean_repeat + 1.0)
        for node in self.rules.values():
            self._check_refs(node)
        self._cost = self._costs()
        self._cheapest: dict[int, _Node] = {}
        self._cumulative: dict[int, list[int]] = {}

    def _check_refs(self, node: _Node) -> None:
        if isinstance(node, _Ref):
            if node.name not in self.rules:
                raise GrammarError(f"rule {node.name!r} is used but not defined")
        elif isinstance(node, _Seq):
            for item in node.items:
                self._check_refs(item)
        elif isinstance(node, _Alt):
            for option in node.options:
                self._check_refs(option)
        elif isinstance(node, _Repeat):
            self._check_refs(node.item)

    def _costs(self) -> dict[str, float]:
        """The least number of characters each rule can produce (fixed point)."""
        cost = dict.fromkeys(self.rules, float("inf"))
        for _ in range(len(self.rules) + 2):
            changed = False
            for name, node in self.rules.items():
                value = self._node_cost(node, cost)
                if value < cost[name]:
                    cost[name] = value
                    changed = True
            if not changed:
                break
        return cost

    def _node_cost(self, node: _Node, cost: dict[str, float]) -> float:
        if isinstance(node, _Lit):
            return len(node.text)
        if isinstance(node, _Class):
            return 1
        if isinstance(node, _Ref):
            return cost[node.name]
        if isinstance(node, _Seq):
            return sum(self._node_cost(item, cost) for item in node.items)
        if isinstance(node, _Alt):
            return min(self._node_cost(option, cost) for option in node.options)
        return node.minimum * self._node_cost(node.item, cost)

    def generate(self, rng: random.Random) -> str:
        """One sentence of the grammar."""
        out: list[str] = []
        self._emit(self.rules["root"], rng, 0, out)
        return "".join(out)

    def _emit(self, node: _Node, rng: random.Random, depth: int, out: list[str]) -> None:
        if isinstance(node, _Lit):
            out.append(node.text)
        elif isinstance(node, _Class):
            out.append(self._char(node, rng))
        elif isinstance(node, _Ref):
            self._emit(self.rules[node.name], rng, depth + 1, out)
        elif isinstance(node, _Seq):
            for item in node.items:
                self._emit(item, rng, depth, out)
        elif isinstance(node, _Alt):
            if depth >= self.max_depth:
                option = self._cheapest.get(id(node))
                if option is None:
                    option = min(node.options, key=lambda opt: self._node_cost(opt, self._cost))
                    self._cheapest[id(node)] = option
            else:
                option = rng.choice(node.options)
            self._emit(option, rng, depth, out)
        else:
            count = node.minimum
            limit = node.maximum if node.maximum is not None else node.minimum + 64
            if depth < self.max_depth:
                while count < limit and rng.random() < self._continue:
                    count += 1
            for _ in range(count):
                self._emit(node.item, rng, depth + 1, out)

    def _char(self, node: _Class, rng: random.Random) -> str:
        if not node.negated:
            if len(node.ranges) == 1:
                low, high = node.ranges[0]
            else:
                cumulative = self._cumulative.get(id(node))
                if cumulative is None:
                    cumulative = self._cumulative[id(node)] = node.cumulative
                low, high = rng.choices(node.ranges, cum_weights=cumulative)[0]
            return chr(low + int(rng.random() * (high - low + 1)))
        for _ in range(32):
            char = rng.choice(_NEGATED_POOL)
            if node.contains(ord(char)):
                return char
        return "a"


# Mutation -------------------------------------------------------------------------------------

#: Byte strings that break parsers: invalid and overlong UTF-8, surrogates, NUL and controls,
#: the span delimiters, operators, quotes and escapes, and Unicode look-alikes of digits and signs.
INTERESTING_BYTES: tuple[bytes, ...] = (
    b"\x00",
    b"\xff",
    b"\xfe\xff",
    b"\xc0\x80",  # overlong NUL
    b"\xed\xa0\x80",  # a UTF-16 surrogate encoded in UTF-8
    b"\xf4\x90\x80\x80",  # above U+10FFFF
    b"\xe2\x82",  # truncated sequence
    b"\x80",
    b"\x1b[31m",
    b"\r\n",
    b"\t",
    b"\x7f",
    b"<",
    b"</calc>",
    b"<result>",
    b"(",
    b")",
    b"**",
    b"-",
    b"--",
    b"+",
    b"/0",
    b"%",
    b".",
    b"e309",
    b"0x1f",
    b"1_000",
    b'"',
    b"\\",
    b"\\u",
    b"\\uD800",
    b"\\u0000",
    b",",
    b" " * 64,
    "\u2212".encode(),  # U+2212 minus sign
    "\uff11\uff12".encode(),  # fullwidth digits
    "٣".encode(),  # Arabic-Indic digit
    "²".encode(),
    "∞".encode(),
    "\u202e".encode(),  # right-to-left override
    "\u200b".encode(),  # zero-width space
    "\ufeff".encode(),  # byte order mark
    "e\u0301".encode(),
    "😀".encode(),
    b"%s%n%x",
    b"{0}",
    b"NaN",
    b"-0",
)


def _flip(data: bytearray, rng: random.Random) -> None:
    if data:
        index = rng.randrange(len(data))
        data[index] ^= 1 << rng.randrange(8)


def _insert(data: bytearray, rng: random.Random) -> None:
    index = rng.randint(0, len(data))
    data[index:index] = rng.choice(INTERESTING_BYTES)


def _delete(data: bytearray, rng: random.Random) -> None:
    if data:
        start = rng.randrange(len(data))
        del data[start : start + rng.randint(1, 8)]


def _duplicate(data: bytearray, rng: random.Random) -> None:
    """Repeats a slice: deeper nesting, longer numbers, longer strings."""
    if data:
        start = rng.randrange(len(data))
        piece = bytes(data[start : start + rng.randint(1, 16)])
        times = rng.choice((2, 3, 10, 100, 1000))
        data[start:start] = piece * times


def _huge_number(data: bytearray, rng: random.Random) -> None:
    index = rng.randint(0, len(data))
    digits = rng.choice((20, 100, 1000, 5000))
    data[index:index] = b"9" * digits


def _truncate(data: bytearray, rng: random.Random) -> None:
    if data:
        del data[rng.randrange(len(data)) :]


def _wrap(data: bytearray, rng: random.Random) -> None:
    depth = rng.choice((1, 10, 300, 3000))
    opener, closer = rng.choice(((b"(", b")"), (b"-(", b")"), (b"reverse(", b")"), (b"[", b"]")))
    data[:0] = opener * depth
    data.extend(closer * depth)


def _replace_char(data: bytearray, rng: random.Random) -> None:
    if data:
        data[rng.randrange(len(data))] = rng.randrange(256)


_OPERATORS = (_flip, _insert, _delete, _duplicate, _huge_number, _truncate, _wrap, _replace_char)


def mutate(
    data: bytes, rng: random.Random, *, other: bytes = b"", max_bytes: int = 1 << 20
) -> bytes:
    """``data`` damaged by one to three random operators (or spliced with ``other``).

    The result never exceeds ``max_bytes`` (it is cut), so a mutated input stays sendable.
    """
    out = bytearray(data)
    if other and rng.random() < 0.15:
        cut = rng.randint(0, len(out))
        start = rng.randint(0, len(other))
        out = out[:cut] + bytearray(other[start:])
    for _ in range(rng.randint(1, 3)):
        rng.choice(_OPERATORS)(out, rng)
    return bytes(out[:max_bytes])
