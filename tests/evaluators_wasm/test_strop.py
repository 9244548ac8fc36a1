"""strop/1: the WASM guest against its conformance cases, its Python reference and its bombs.

The differential tests compare the whole outcome, message included: the guest and the reference
are written with the same single-pass structure, so they must agree on which error an input with
several problems gets, and on every byte of the value.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evaluators_wasm.reference import strop as ref
from tests.evaluators_wasm.support import (
    MIB,
    PROPERTY_TIMEOUT,
    DefaultLimitsGuest,
    Evaluator,
    Guest,
    mutated,
    property_settings,
)

STROP = Evaluator("strop", {"syntax", "overflow", "too_large"})
PROPERTY = property_settings()


# --- conformance ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", STROP.cases, ids=lambda c: repr(STROP.data(c)[:60]))
def test_conformance(guest: Guest, case: dict[str, Any]) -> None:
    STROP.check_case(guest, case)


def test_conformance_covers_every_function_and_error() -> None:
    for name in ("count", "len", "reverse", "upper", "lower", "substr", "index", "replace"):
        assert f"{name}(" in STROP.conformance_text
    assert {"syntax", "overflow", "too_large"} <= STROP.case_codes()


# --- differential (hypothesis) --------------------------------------------------------------

# Characters that hit the rules: quotes, escapes, <>, controls, the case table and its edges.
_SPECIAL = [*'"\\<>\n\t\r\x00\x1f\x7f aAzZ@[`{', *map(chr, (
    0xDF, 0xFF, 0x178, 0xB5, 0xD7, 0xF7, 0x3C2, 0x3A3, 0x3C3, 0x390, 0x3AC, 0x386,
    0x400, 0x450, 0x42F, 0x44F, 0x461, 0x130, 0x1F600, 0xE9, 0x301, 0xFFFF))]
_CHARS = st.one_of(st.characters(codec="utf-8"), st.sampled_from(_SPECIAL))
_WS = st.sampled_from(["", "", "", " ", "  ", "\n", "\t", "\r\n "])


@st.composite
def literal(draw: st.DrawFn) -> str:
    """A literal, each character written raw or escaped at random."""
    value = draw(st.one_of(st.text("ab", max_size=10), st.text(_CHARS, max_size=12)))
    out = ['"']
    for c in value:
        forms = ['\\"' if c == '"' else "\\\\" if c == "\\" else c]
        forms.append(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else forms[0])
        forms.append(f"\\u{ord(c):04X}" if ord(c) < 0x10000 else forms[0])
        if c in "\n\t":
            forms.append("\\n" if c == "\n" else "\\t")
        out.append(draw(st.sampled_from(forms)))
    out.append('"')
    return "".join(out)


@st.composite
def integer(draw: st.DrawFn) -> str:
    n = draw(st.one_of(st.integers(-12, 12), st.integers(-(2 * 10**9), 2 * 10**9)))
    zeros = draw(st.sampled_from(["", "", "0", "000"]))
    return ("-" if n < 0 else "") + zeros + str(abs(n))


def _call(draw: st.DrawFn, name: str, args: list[str]) -> str:
    ws = [draw(_WS) for _ in range(2 * len(args) + 2)]
    inner = ",".join(ws[2 * i] + a + ws[2 * i + 1] for i, a in enumerate(args))
    return f"{name}{ws[-2]}({inner}{ws[-1]})"


MAX_GENERATED_DEPTH = 4  # calls; the evaluator's own limit (16) is tested on its own


@st.composite
def str_expr(draw: st.DrawFn, depth: int = 0) -> str:
    if depth >= MAX_GENERATED_DEPTH or draw(st.integers(0, 2)) == 0:
        return draw(literal())
    name = draw(st.sampled_from(["reverse", "upper", "lower", "substr", "replace"]))
    if name == "substr":
        args = [draw(str_expr(depth + 1)), draw(int_arg(depth + 1)), draw(int_arg(depth + 1))]
    elif name == "replace":
        args = [draw(str_expr(depth + 1)) for _ in range(3)]
    else:
        args = [draw(str_expr(depth + 1))]
    return _call(draw, name, args)


@st.composite
def int_expr(draw: st.DrawFn, depth: int = 0) -> str:
    name = draw(st.sampled_from(["count", "len", "index"]))
    arity = 1 if name == "len" else 2
    return _call(draw, name, [draw(str_expr(depth + 1)) for _ in range(arity)])


@st.composite
def int_arg(draw: st.DrawFn, depth: int) -> str:
    if depth >= MAX_GENERATED_DEPTH or draw(st.booleans()):
        return draw(integer())
    return draw(int_expr(depth))


@st.composite
def valid_input(draw: st.DrawFn) -> bytes:
    body = draw(st.one_of(str_expr(), int_expr(), integer()))
    return (draw(_WS) + body + draw(_WS)).encode("utf-8")


mutated_input = mutated(valid_input(), st.binary(min_size=1, max_size=3))


_TOKENS = [b"len", b"count", b"upper", b"substr", b"replace", b"index", b"(", b")", b",", b'"',
           b'"a"', b"\\", b"\\u", b"00e9", b"-", b"1", b"99999999999", b" ", b"\n",
           "é".encode(), b"<", b"\xff", b"\xe2\x82"]
token_soup = st.lists(st.sampled_from(_TOKENS), max_size=12).map(b"".join)


@PROPERTY_TIMEOUT
@PROPERTY
@given(data=valid_input())
def test_differential_valid(guest: Guest, data: bytes) -> None:
    STROP.assert_agree(guest, data)


@PROPERTY_TIMEOUT
@PROPERTY
@given(data=st.one_of(mutated_input, token_soup, st.binary(max_size=40)))
def test_differential_garbage(guest: Guest, data: bytes) -> None:
    STROP.assert_agree(guest, data)


@PROPERTY_TIMEOUT
@PROPERTY
@given(haystack=st.text("ab", max_size=30), needle=st.text("ab", max_size=4),
       new=st.text("abc", max_size=3))
def test_differential_search_ops(guest: Guest, haystack: str, needle: str, new: str) -> None:
    """Dense alphabets make matches overlap, which is where count/index/replace can differ."""
    for expr in (f'count("{haystack}", "{needle}")', f'index("{haystack}", "{needle}")',
                 f'replace("{haystack}", "{needle}", "{new}")'):
        STROP.assert_agree(guest, expr.encode())


def test_search_ops_match_python_str() -> None:
    """count/index/replace are exactly Python's str.count/find/replace (as documented)."""
    for haystack in ("", "a", "aaa", "abab", "aabaab"):
        for needle in ("", "a", "aa", "ab", "b", "aab"):
            assert ref.evaluate(f'count("{haystack}", "{needle}")'.encode()) == str(
                haystack.count(needle))
            assert ref.evaluate(f'index("{haystack}", "{needle}")'.encode()) == str(
                haystack.find(needle))
            assert ref.evaluate(f'replace("{haystack}", "{needle}", "x")'.encode()) == (
                '"' + haystack.replace(needle, "x") + '"')


def test_case_table_is_unicode_simple_mapping_subset() -> None:
    """Every pair in the table is what Unicode maps that single code point to."""
    for lo, up in ref.LOWER_TO_UPPER.items():
        assert chr(lo).upper() == chr(up), hex(lo)
    for up, lo in ref.UPPER_TO_LOWER.items():
        assert chr(up).lower() == chr(lo), hex(up)


def test_case_table_whole_ranges_agree(guest: Guest) -> None:
    """upper/lower over every code point below U+0500 (plus Ÿ) in one call each."""
    text = "".join(chr(c) for c in range(0x20, 0x500) if c not in (0x22, 0x5C))
    for fn in ("upper", "lower"):
        STROP.assert_agree(guest, f'{fn}("{text}")'.encode())


# --- limits: n passes, n + 1 fails ----------------------------------------------------------


def _literal_of(n: int, char: str = "a") -> str:
    return '"' + char * n + '"'


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (f"len({_literal_of(100_000)})", ("100000", None)),
        (f"len({_literal_of(100_001)})", (None, "too_large")),
        (f"len({_literal_of(100_000, '😀')})", ("100000", None)),
        (f"len({_literal_of(100_001, '😀')})", (None, "too_large")),
        # 10 string values of 100,000 code points: the per-input total of 1,000,000.
        ("len(" + "upper(" * 9 + _literal_of(100_000) + ")" * 10, ("100000", None)),
        ("len(" + "upper(" * 10 + _literal_of(100_000) + ")" * 11, (None, "too_large")),
        # The output buffer: two quotes + 65,534 bytes fit; one more does not.
        (_literal_of(65_534), ('"' + "a" * 65_534 + '"', None)),
        (_literal_of(65_535), (None, "too_large")),
        (f"reverse({_literal_of(10_922, '<')})", ('"' + "\\u003c" * 10_922 + '"', None)),
        (f"reverse({_literal_of(10_923, '<')})", (None, "too_large")),
    ],
    ids=["string-100000", "string-100001", "astral-100000", "astral-100001", "total-1000000",
         "total-1100000", "output-65536", "output-65537", "escaped-65534", "escaped-65540"],
)
def test_limit_pairs(guest: Guest, data: str, expected: tuple[str | None, str | None]) -> None:
    outcome = STROP.assert_agree(guest, data.encode("utf-8"))
    assert outcome[:2] == expected


# --- bombs: a typed error (or a value) within the default limits, never a trap or a hang -----

_BOMBS: list[tuple[str, bytes, str | None]] = [
    ("1MiB-string-argument", b'len("' + b"a" * (MIB - 8) + b'")', "too_large"),
    ("1MiB-of-escapes", b'len("' + b"\\u00e9" * ((MIB - 8) // 6) + b'")', "too_large"),
    ("1MiB-number", b'substr("abc", ' + b"9" * (MIB - 24) + b", 1)", "overflow"),
    ("1MiB-leading-zeros", b'substr("abc", ' + b"0" * (MIB - 24) + b"1, 9)", None),
    ("100000-nested-calls", b"upper(" * 100_000 + b'"a"' + b")" * 100_000, "too_large"),
    ("100000-nested-parens", b"(" * 100_000 + b")" * 100_000, "syntax"),
    ("1MiB-whitespace", b" " * MIB, "syntax"),
    ("1MiB-name", b"a" * MIB, "syntax"),
    ("invalid-utf8-at-the-end", b'"' + b"a" * (MIB - 3) + b'\xff"', "syntax"),
    ("replace-explosion", b'replace("' + b"a" * 1000 + b'", "a", "' + b"b" * 1000 + b'")',
     "too_large"),
    ("search-worst-case",
     f'count("{"a" * 99_990}", "{"a" * 49_999}b")'.encode(), None),
    ("many-sibling-calls", b"len(" + b"replace(" * 15 + b'"x"' + b', "x", "xx")' * 15 + b")",
     None),
]


@pytest.mark.parametrize(("data", "code"), [b[1:] for b in _BOMBS], ids=[b[0] for b in _BOMBS])
def test_bombs(default_limits_guest: DefaultLimitsGuest, data: bytes, code: str | None) -> None:
    STROP.check_bomb(default_limits_guest, data, code)


# --- grammar and result regex ---------------------------------------------------------------


@st.composite
def model_input(draw: st.DrawFn) -> str:
    """What grammar.ebnf lets a model write (literals of any length without < or newline; here
    up to 100 pieces)."""

    def sp() -> str:
        return draw(st.sampled_from(["", " "]))

    def lit() -> str:
        chars = st.characters(codec="utf-8", exclude_characters='"\\<\n')
        parts = draw(st.lists(st.one_of(chars, st.sampled_from(['\\"', "\\\\", "\\n", "\\t",
                                                                "\\u003c", "\\u00E9"])),
                              max_size=100))
        return '"' + "".join(parts) + '"'

    def int_arg(depth: int) -> str:
        if depth < 2 and draw(st.booleans()):
            return int_e(depth)
        return draw(st.sampled_from(["", "-"])) + str(draw(st.integers(0, 9999)))

    def str_e(depth: int) -> str:
        if depth >= 2 or draw(st.booleans()):  # calls nest at most 2 deep
            return lit()
        name = draw(st.sampled_from(["reverse", "upper", "lower", "substr", "replace"]))
        if name == "substr":
            a, b, c = str_e(depth + 1), int_arg(depth + 1), int_arg(depth + 1)
            return f"substr({sp()}{a}{sp()},{sp()}{b}{sp()},{sp()}{c}{sp()})"
        if name == "replace":
            a, b, c = (str_e(depth + 1) for _ in range(3))
            return f"replace({sp()}{a}{sp()},{sp()}{b}{sp()},{sp()}{c}{sp()})"
        return f"{name}({sp()}{str_e(depth + 1)}{sp()})"

    def int_e(depth: int) -> str:
        name = draw(st.sampled_from(["len", "count", "index"]))
        if name == "len":
            return f"len({sp()}{str_e(depth + 1)}{sp()})"
        a, b = str_e(depth + 1), str_e(depth + 1)
        return f"{name}({sp()}{a}{sp()},{sp()}{b}{sp()})"

    return str_e(0) if draw(st.booleans()) else int_e(0)


def test_grammar_never_produces_lt() -> None:
    """The only `<` in the grammar is inside the negated literal-character class."""
    assert '[^"\\\\<\\n]' in STROP.grammar
    STROP.check_cannot_produce_lt()


@PROPERTY_TIMEOUT
@property_settings(full=1_000, quick=60)
@given(text=model_input())
def test_model_grammar_inputs_are_accepted(guest: Guest, text: str) -> None:
    """Whatever the grammar lets a model write, the evaluator parses (no `syntax` error)."""
    STROP.check_model_input(guest, text)


@pytest.mark.parametrize(
    ("within", "over"),
    [
        ('substr(substr("abc", 0, 2), 0, 1)', 'substr(substr(substr("abc", 0, 2), 0, 1), 0, 1)'),
        ('count(lower("ABA"), "a")', 'count(lower(upper("aba")), "a")'),
        ('substr("abc", 0, len("ab"))', 'substr("abc", 0, len(lower("ab")))'),
    ],
)
def test_model_grammar_bounds_nesting(guest: Guest, within: str, over: str) -> None:
    """A span cannot loop on ``substr(substr(…``: calls nest at most 2 deep in the grammar,
    while the evaluator still accepts the deeper form."""
    assert STROP.grammar_accepts(within), within
    assert not STROP.grammar_accepts(over), over
    assert STROP.assert_agree(guest, over.encode())[1] != "syntax"


def test_grammar_rejects_what_the_model_may_not_write() -> None:
    assert STROP.grammar_accepts('count("strawberry", "r")')
    assert STROP.grammar_accepts('len("' + "a" * 1000 + '")')  # no length bound: see strop.md
    for text in ('len("a<b")', "substr(\"a\", 12345, 1)", 'len("a")</strop>', "LEN(\"a\")",
                 'len("a\\q")', 'len("a\\u00e")', 'len( "a")  ', 'len("a\nb")'):
        assert not STROP.grammar_accepts(text), text


def test_result_regex_in_xgrammar_agrees_with_python_re(guest: Guest) -> None:
    """The regex means the same to XGrammar as to `re` (used by the differential tests)."""
    extra = ['"a<b"', '"\\q"', '"\x01"', "-2", "01", '"unterminated', "1234567"]
    STROP.check_regex_agrees_with_python_re(guest, extra, minimum=51)


def test_grammar_compiles_for_the_real_tokenizer() -> None:
    """Compiled against SmolLM2's vocabulary, the tokens of a real span walk the matcher."""
    STROP.check_tokens_walk('count("strawberry", "r")')
