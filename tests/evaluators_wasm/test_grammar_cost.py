"""The standard input grammars avoid the rule shapes that make XGrammar slow for an engine.

A grammar is compiled once per request and its bitmask is filled on every decode step, so a
shape that costs milliseconds costs them on every token of the span. Measured with xgrammar 0.2.7
and SmolLM2's tokenizer (``bench_mask_fill.py`` prints the numbers; they are not asserted here,
the shapes are):

- a repeated alternation of single characters (``char*`` or ``char{0,100}`` with
  ``char ::= [^"\\<\\n] | "\\\\" …``): 50-70 ms per fill inside a string literal (120-400 ms on a
  loaded machine). The same language as a run of one character class with each escape and the
  run after it in one rule (``"\\"" [^"\\<\\n]* escaped_run* "\\""``) fills in 25-140 µs;
- a bounded repetition of a negated (wide) character class (``[^"\\<\\n]{0,100}``): 7-12 s to
  compile, against 15-30 ms unbounded;
- a rule that is wholly optional (``sp ::= " "?``) used between the parts of a sequence:
  100-180 µs per fill around it (1-3 ms on a loaded machine); spelling the optional space into
  the neighbouring literals (``"," | ", "``) brings those fills to 3-20 µs.

These checks read the EBNF text, so they need neither XGrammar nor the tokenizer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from evald.contract import STANDARD_EVALUATORS
from evaluators_wasm import SOURCE_DIR

# --- a small EBNF reader (the subset XGrammar accepts and these grammars use) -----------------

_TOKEN = re.compile(
    r'\s+|#[^\n]*|(?P<lit>"(?:\\.|[^"\\])*")|(?P<cls>\[(?:\\.|[^\]\\])*\])'
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_-]*)|(?P<op>::=|[()|*+?])|(?P<range>\{\s*\d*\s*(?:,\s*\d*\s*)?\})"
)


@dataclass(frozen=True)
class Node:
    """``kind`` is lit, cls, ref, seq, alt or rep; ``text`` the token (rep: the operator)."""

    kind: str
    text: str = ""
    items: tuple[Node, ...] = ()


def _tokens(text: str) -> list[tuple[str, str]]:
    out, at = [], 0
    while at < len(text):
        match = _TOKEN.match(text, at)
        if not match:
            raise ValueError(f"cannot read the grammar at {text[at:at + 30]!r}")
        at = match.end()
        if match.lastgroup:
            out.append((match.lastgroup, match.group()))
    return out


def parse_rules(text: str) -> dict[str, Node]:
    """Rule name -> body. A rule starts at ``name ::=`` and runs to the next one."""
    tokens = _tokens(text)
    starts = [i for i in range(len(tokens) - 1)
              if tokens[i][0] == "name" and tokens[i + 1] == ("op", "::=")]
    rules = {}
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(tokens)
        body, rest = _alternation(tokens[start + 2 : end])
        if rest:
            raise ValueError(f"rule {tokens[start][1]}: unexpected {rest[0][1]!r}")
        rules[tokens[start][1]] = body
    return rules


def _alternation(tokens: list[tuple[str, str]]) -> tuple[Node, list[tuple[str, str]]]:
    branches = []
    while True:
        branch, tokens = _sequence(tokens)
        branches.append(branch)
        if tokens[:1] != [("op", "|")]:
            break
        tokens = tokens[1:]
    return (branches[0] if len(branches) == 1 else Node("alt", items=tuple(branches))), tokens


def _sequence(tokens: list[tuple[str, str]]) -> tuple[Node, list[tuple[str, str]]]:
    items = []
    while tokens and tokens[0] not in (("op", "|"), ("op", ")")):
        kind, text = tokens[0]
        if (kind, text) == ("op", "("):
            item, tokens = _alternation(tokens[1:])
            if tokens[:1] != [("op", ")")]:
                raise ValueError("unbalanced parenthesis")
            tokens = tokens[1:]
        elif kind in ("lit", "cls", "name"):
            item, tokens = Node("ref" if kind == "name" else kind, text), tokens[1:]
        else:
            raise ValueError(f"unexpected {text!r}")
        while tokens and (tokens[0][0] == "range" or tokens[0][1] in ("*", "+", "?")):
            item, tokens = Node("rep", tokens[0][1].replace(" ", ""), (item,)), tokens[1:]
        items.append(item)
    return (items[0] if len(items) == 1 else Node("seq", items=tuple(items))), tokens


def _walk(node: Node) -> list[Node]:
    return [node, *(n for item in node.items for n in _walk(item))]


# --- the shapes ---------------------------------------------------------------------------


def _single_character(node: Node) -> bool:
    if node.kind == "cls":
        return True
    if node.kind == "lit":
        inner = node.text[1:-1]
        return len(inner) == 1 or (len(inner) == 2 and inner[0] == "\\")
    return False


def _resolve(node: Node, rules: dict[str, Node]) -> Node:
    seen = set()
    while node.kind == "ref" and node.text in rules and node.text not in seen:
        seen.add(node.text)
        node = rules[node.text]
    return node


def _repeats_many(operator: str) -> bool:
    """``*``, ``+`` or a range whose upper bound is above 1 (or open)."""
    if operator in ("*", "+"):
        return True
    if operator == "?":
        return False
    upper = operator.strip("{}").split(",")[-1]
    return upper == "" or int(upper) > 1


def slow_shapes(text: str) -> list[str]:
    """The places where ``text`` (XGrammar EBNF) uses a shape this module's docstring measures
    as slow; one line each, naming the rule."""
    rules = parse_rules(text)
    problems = []
    for name, body in rules.items():
        if body.kind == "rep" and body.text == "?":
            problems.append(f"{name}: the whole rule is optional; write the optional part into "
                            "the neighbouring literals")
        for node in _walk(body):
            if node.kind != "rep" or not _repeats_many(node.text):
                continue
            target = _resolve(node.items[0], rules)
            if target.kind == "alt" and any(_single_character(b) for b in target.items):
                problems.append(f"{name}: repeats an alternation of single characters "
                                f"({node.text}); write a run of one character class instead")
            if node.text.startswith("{") and target.kind == "cls" and target.text.startswith("[^"):
                problems.append(f"{name}: bounds a negated character class with {node.text}")
    return problems


# --- tests ----------------------------------------------------------------------------------


def _grammar(name: str) -> str:
    return (SOURCE_DIR / name / "grammar.ebnf").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", STANDARD_EVALUATORS)
def test_standard_grammar_has_no_slow_shape(name: str) -> None:
    assert parse_rules(_grammar(name))["root"]
    assert slow_shapes(_grammar(name)) == []


#: The shapes the standard grammars had before (strop, checksum, calc and date).
_SLOW_BEFORE = {
    "bounded char": 'root ::= "\\"" char{0,100} "\\""\n'
                    'char ::= [^"\\\\<\\n] | "\\\\" (["\\\\nt] | "u" [0-9a-f] [0-9a-f])',
    "char star": 'root ::= "\\"" char* "\\""\nchar ::= [^"\\\\<\\n] | "\\\\" ["\\\\nt]',
    "inline char star": 'root ::= "\\"" ([^"\\\\<\\n] | "\\\\" ["\\\\nt])* "\\""',
    "bounded negated class": 'root ::= "\\"" [^"\\\\<\\n]{0,100} "\\""',
    "optional space rule": 'root ::= "f(" sp [0-9]+ sp ")"\nsp ::= " "?',
}


@pytest.mark.parametrize("grammar", list(_SLOW_BEFORE.values()), ids=list(_SLOW_BEFORE))
def test_the_check_finds_each_slow_shape(grammar: str) -> None:
    assert len(slow_shapes(grammar)) == 1, slow_shapes(grammar)


def test_the_check_leaves_the_fast_forms_alone() -> None:
    fast = ('root ::= "f" ("(" | "( ") string ("," | ", ") [0-9] [0-9]{0,3} (")" | " )")\n'
            'string ::= "\\"" [^"\\\\<\\n]* escaped_run* "\\""\n'
            'escaped_run ::= "\\\\" ["\\\\nt] [^"\\\\<\\n]*'
            ' | "\\\\u" [0-9a-f] [0-9a-f] [^"\\\\<\\n]*')
    assert slow_shapes(fast) == []
    assert set(parse_rules(fast)) == {"root", "string", "escaped_run"}


def test_the_reader_understands_every_standard_grammar() -> None:
    """Every rule the grammars reference is defined, so the resolution above sees them all."""
    for name in STANDARD_EVALUATORS:
        rules = parse_rules(_grammar(name))
        refs = {n.text for body in rules.values() for n in _walk(body) if n.kind == "ref"}
        assert refs <= set(rules), (name, refs - set(rules))
