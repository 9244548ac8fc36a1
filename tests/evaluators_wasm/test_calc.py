"""calc/1: the WASM guest against its conformance cases, its Python reference and its bombs.

The differential tests compare the whole outcome, message included: the guest and the reference
find errors in the same order (every syntax and size error before any arithmetic error), so they
must agree on which error an input with several problems gets, and on every byte of the value.
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Context, Decimal
from fractions import Fraction
from typing import Any

import pytest
import wasmtime
from hypothesis import given
from hypothesis import strategies as st

from evaluators_wasm import wasm_path
from evaluators_wasm.reference import calc as ref
from tests.evaluators_wasm.support import (
    MIB,
    PROPERTY_TIMEOUT,
    DefaultLimitsGuest,
    Evaluator,
    Guest,
    Outcome,
    mutated,
    property_settings,
)

CALC = Evaluator("calc", {"syntax", "division_by_zero", "overflow", "domain", "too_large"})
PROPERTY = property_settings()
SMALLER = property_settings(full=2_000, quick=60)


def assert_agree(guest: Guest, data: bytes) -> Outcome:
    """As :meth:`Evaluator.assert_agree`; a zero is never written ``-0``."""
    outcome = CALC.assert_agree(guest, data)
    assert outcome[0] != "-0"
    return outcome


# --- conformance ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CALC.cases, ids=lambda c: repr(CALC.data(c)[:40]))
def test_conformance(guest: Guest, case: dict[str, Any]) -> None:
    CALC.check_case(guest, case)


def test_conformance_covers_every_operator_and_error() -> None:
    text = "".join(c.get("input", "") for c in CALC.cases)
    for op in ("+", "-", "*", "/", "%", "**", "(", ")", "."):
        assert op in text
    assert CALC.case_codes() >= CALC.error_codes
    assert any("input_b64" in c for c in CALC.cases)


# --- differential (hypothesis) --------------------------------------------------------------

_WS = st.sampled_from(["", "", "", "", " ", " ", "  ", "\t", "\n", " \r\n"])
_I64_EDGES = [2**31 - 1, 2**31, 2**62, 2**63 - 1, 2**63, 2**64, 3037000499, 3037000500]


@st.composite
def number(draw: st.DrawFn) -> str:
    kind = draw(st.integers(0, 9))
    if kind <= 3:
        text = str(draw(st.integers(0, 999)))
    elif kind == 4:
        text = str(draw(st.integers(0, 10**40)))
    elif kind == 5:
        text = str(draw(st.sampled_from(_I64_EDGES)))
    elif kind <= 7:
        whole = draw(st.sampled_from(["", "0", "1", "12", str(draw(st.integers(0, 10**6)))]))
        text = whole + "." + draw(st.text("0123456789", min_size=1, max_size=8))
    else:
        text = draw(st.text("0123456789", min_size=1, max_size=30))
        text += draw(st.sampled_from(["", "." + draw(st.text("0123456789", min_size=1,
                                                             max_size=30))]))
    return draw(st.sampled_from(["", "", "", "0", "00"])) + text


@st.composite
def exponent(draw: st.DrawFn) -> str:
    """Mostly small integers; sometimes what the power rules care about."""
    return draw(st.one_of(
        st.integers(-12, 12).map(str),
        st.integers(-300, 300).map(lambda n: f"({n})"),
        st.sampled_from(["0", "-0", "0.5", "(1/2)", "(4/2)", "2.0", "(-1)", "64", "63",
                         "(10**20)", "-(10**20)", "99999"]),
    ))


@st.composite
def expression(draw: st.DrawFn, depth: int = 0) -> str:
    if depth >= 4 or draw(st.integers(0, 3)) == 0:
        return draw(number())
    kind = draw(st.integers(0, 9))
    if kind <= 5:
        op = draw(st.sampled_from(["+", "-", "*", "/", "%", "+", "-", "*", "/"]))
        left, right = draw(expression(depth + 1)), draw(expression(depth + 1))
        return f"{left}{draw(_WS)}{op}{draw(_WS)}{right}"
    if kind == 6:
        return f"{draw(expression(depth + 1))}{draw(_WS)}**{draw(_WS)}{draw(exponent())}"
    if kind == 7:
        sign = draw(st.sampled_from(["-", "+", "--", "-+"]))
        return f"{sign}{draw(_WS)}{draw(expression(depth + 1))}"
    return f"({draw(_WS)}{draw(expression(depth + 1))}{draw(_WS)})"


@st.composite
def valid_input(draw: st.DrawFn) -> bytes:
    return (draw(_WS) + draw(expression()) + draw(_WS)).encode()


mutated_input = mutated(valid_input(), st.one_of(
    st.sampled_from([b"(", b")", b"*", b"**", b".", b"-", b"+", b"/", b"%", b"0", b"9", b" ",
                     b"e", b"\xff", b"\xc3", b"\x00"]),
    st.binary(min_size=1, max_size=3)))


_TOKENS = [b"1", b"0", b"7", b"9223372036854775807", b".", b"5", b"+", b"-", b"*", b"**", b"/",
           b"%", b"(", b")", b" ", b"\t", b"e", b"\xff", b"0.5", b"2**", b"1/0", b"3",
           b"0**", b"(-1)"]
token_soup = st.lists(st.sampled_from(_TOKENS), max_size=14).map(b"".join)


@PROPERTY_TIMEOUT
@PROPERTY
@given(data=valid_input())
def test_differential_valid(guest: Guest, data: bytes) -> None:
    assert_agree(guest, data)


@PROPERTY_TIMEOUT
@PROPERTY
@given(data=st.one_of(mutated_input, token_soup, st.binary(max_size=30)))
def test_differential_garbage(guest: Guest, data: bytes) -> None:
    assert_agree(guest, data)


@st.composite
def big_operand(draw: st.DrawFn) -> str:
    """Values well beyond i64: powers, long literals, big fractions."""
    kind = draw(st.integers(0, 4))
    if kind == 0:
        base = draw(st.sampled_from(["2", "3", "7", "10", "(2/3)", "(-5/7)", "1.1", "(-3)",
                                     "99999999999", "(1/9223372036854775807)"]))
        return f"{base}**{draw(st.integers(-400, 400))}"
    if kind == 1:
        return str(draw(st.integers(-(10**80), 10**80)))
    if kind == 2:
        p = draw(st.integers(-(10**60), 10**60))
        q = draw(st.integers(1, 10**60))
        return f"({p}/{q})"
    if kind == 3:
        g = draw(st.integers(2, 10**30))
        a, b = draw(st.integers(1, 10**30)), draw(st.integers(1, 10**30))
        return f"(({a}*{g})/({b}*{g}))"
    return f"0.{draw(st.text('0123456789', min_size=20, max_size=80))}"


@PROPERTY_TIMEOUT
@SMALLER
@given(a=big_operand(), b=big_operand(), c=big_operand(),
       ops=st.lists(st.sampled_from(["+", "-", "*", "/", "%"]), min_size=1, max_size=2))
def test_differential_big(guest: Guest, a: str, b: str, c: str, ops: list[str]) -> None:
    """The big-integer paths: reduction, sign handling, gcd, rounding of big fractions."""
    operands = [a, b, c]
    text = operands[0] + "".join(op + operands[i + 1] for i, op in enumerate(ops))
    assert_agree(guest, text.encode())


def _fibonacci(n: int) -> tuple[int, int]:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a, b


@pytest.mark.parametrize("n", [2, 40, 92, 93, 94, 200, 1000, 3000])
def test_gcd_worst_cases(guest: Guest, n: int) -> None:
    """Consecutive Fibonacci numbers make Euclid take the most steps (every quotient is 1)."""
    f0, f1 = _fibonacci(n)
    for text in (f"{f1}/{f0}", f"{f1 * f0}/{f0 * f0}", f"({f1}/{f0}) - ({f0}/{f1})",
                 f"({f1}/{f0 * 6}) + ({f0}/{f1 * 6})", f"({f1}/{f0}) % ({f0}/{f1})",
                 f"({f1 * 2**100}/{f0 * 3**60}) * ({f0 * 3**60}/{f1 * 2**99})"):
        assert_agree(guest, text.encode())


def _decimal_oracle(p: int, q: int) -> str:
    """The canonical text as Python's decimal module computes it (28 digits, half-even)."""
    if p % q == 0:
        return str(p // q)
    context = Context(prec=28, rounding=ROUND_HALF_EVEN, Emax=10**6, Emin=-(10**6))
    text = format(context.divide(Decimal(p), Decimal(q)), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


@PROPERTY_TIMEOUT
@SMALLER
@given(p=st.one_of(st.integers(-(10**40), 10**40), st.integers(-1000, 1000)),
       q=st.one_of(st.integers(1, 10**40), st.integers(1, 1000),
                   st.sampled_from([2**63 - 1, 2**63, 2**64 + 1, 3 * 2**61, 10**28])))
def test_rounding_matches_python_decimal(guest: Guest, p: int, q: int) -> None:
    """Rounding is exactly decimal's: the reference, the guest and the decimal module agree."""
    expected = _decimal_oracle(p, q)
    assert ref.evaluate(f"{p}/{q}".encode()) == expected
    assert guest(CALC.name, f"{p}/{q}".encode())[0] == expected


@pytest.mark.parametrize("digits", [27, 28, 29, 30])
def test_rounding_ties_go_to_even(guest: Guest, digits: int) -> None:
    """Exact ties at the 29th significant digit, with odd and even 28th digits."""
    for head in ("1", "3", "-7", "9" * 10):
        for last in "0123456789":
            body = head + "0" * max(0, digits - len(head.lstrip("-")) - 1) + last
            for tail in ("5", "50", "49", "51"):
                text = f"{body}{tail}/1{'0' * (digits + len(tail) - 1)}"
                value = Fraction(int(body + tail), 10 ** (digits + len(tail) - 1))
                expected = _decimal_oracle(value.numerator, value.denominator)
                assert ref.evaluate(text.encode()) == expected, text
                assert guest(CALC.name, text.encode())[0] == expected, text


# --- bombs: a typed guest error (or a value) within the host's default limits ---------------

_BOMBS: list[tuple[str, bytes, str | None]] = [
    ("1MiB-number", b"1" * MIB, "too_large"),
    ("1MiB-decimal", b"0." + b"1" * (MIB - 2), "too_large"),
    ("1MiB-number-after-an-operator", b"1+" + b"9" * (MIB - 2), "too_large"),
    ("100000-nested-parens", b"(" * 100_000 + b"1" + b")" * 100_000, "too_large"),
    ("1MiB-of-signs", b"-" * MIB, "too_large"),
    ("1MiB-of-whitespace", b" " * MIB, "syntax"),
    ("invalid-utf8-after-1MiB", b"1" + b" " * (MIB - 2) + b"\xff", "syntax"),
    ("9**9**9**9", b"9**9**9**9", "overflow"),
    ("10**10**10", b"10**10**10", "overflow"),
    ("2**2**2**2**2**2", b"2**2**2**2**2**2", "overflow"),
    ("exponent-of-1000-digits", b"2**" + b"9" * 1000, "overflow"),
    ("huge-to-huge", b"(2**16383)**(2**16383)", "overflow"),
    ("repeated-squaring", b"((((2**64)**64)**64)**64)", "overflow"),
    ("1/0", b"1/0", "division_by_zero"),
    ("0**-1", b"0**-1", "division_by_zero"),
    ("largest-integer-result", b"10**4300-1", None),
    ("smallest-result", b"10**-4300", None),
    ("largest-operands", b"(3**10337-1)/(2**16383+1)*0", None),
    ("largest-fraction-remainder",
     b"(3**10000+1)/(2**16000+3)%((5**7000+1)/(3**10300+5))", None),
    ("40000-small-additions", b"1+" * 40_000 + b"1", None),
    ("long-literals", b"+".join([b"7" * 1000] * 50), None),
]


@pytest.mark.parametrize(("data", "code"), [b[1:] for b in _BOMBS], ids=[b[0] for b in _BOMBS])
def test_bombs(default_limits_guest: DefaultLimitsGuest, data: bytes, code: str | None) -> None:
    outcome = CALC.check_bomb(default_limits_guest, data, code)
    assert outcome[0] != "-0"


def test_reused_instance_keeps_no_state() -> None:
    """One instance, many calls: results equal fresh ones and memory stops growing."""
    config = wasmtime.Config()
    config.consume_fuel = True
    engine = wasmtime.Engine(config)
    store = wasmtime.Store(engine)
    store.set_limits(memory_size=64 * MIB)
    store.set_fuel(1_000_000)
    module = wasmtime.Module.from_file(engine, str(wasm_path(CALC.name)))
    instance = wasmtime.Instance(store, module, [])
    exports = instance.exports(store)
    memory, evaluate = exports["memory"], exports["evald_eval"]
    in_ptr, out_ptr = exports["evald_input_ptr"](store), exports["evald_output_ptr"](store)

    def call(data: bytes) -> str:
        store.set_fuel(2_000_000_000)
        memory.write(store, data, in_ptr)
        n = evaluate(store, len(data))
        return bytes(memory.read(store, out_ptr, out_ptr + abs(n))).decode()

    heavy = b"(3**10000+1)/(2**16000+3) + (5**7000+1)/(3**10300+5)"
    inputs = [heavy, b"17 * 23 + 91", b"1/0", b"(" * 300, b"2**-3**2", b"1" * 1001, heavy]
    first = [call(d) for d in inputs]
    pages = memory.size(store)
    for _ in range(5):
        assert [call(d) for d in inputs] == first
    assert memory.size(store) == pages
    assert first[1] == "482" and first[2].startswith("division_by_zero:")


# --- grammar and result regex ---------------------------------------------------------------


@st.composite
def model_input(draw: st.DrawFn) -> str:
    """What grammar.ebnf lets a model write, up to its bounds: 12 integer digits, 6 decimals,
    single spaces, 4 terms, 3 factors, one ``**`` per factor, parentheses 2 deep."""

    def sp() -> str:
        return draw(st.sampled_from(["", " "]))

    def num() -> str:
        whole = draw(st.one_of(st.just("0"), st.integers(1, 10**12 - 1).map(str)))
        if draw(st.booleans()):
            return whole
        return whole + "." + draw(st.text("0123456789", min_size=1, max_size=6))

    def atom(depth: int) -> str:
        if depth < 2 and draw(st.integers(0, 3)) == 0:
            return f"({sp()}{expr(depth + 1)}{sp()})"
        return num()

    def factor(depth: int) -> str:
        text = draw(st.sampled_from(["", "", "-"])) + atom(depth)
        if draw(st.integers(0, 4)) == 0:
            text += f"{sp()}**{sp()}{draw(st.sampled_from(['', '-']))}{atom(depth)}"
        return text

    def term(depth: int) -> str:
        text = factor(depth)
        for _ in range(draw(st.integers(0, 2))):
            text += f"{sp()}{draw(st.sampled_from('*/%'))}{sp()}{factor(depth)}"
        return text

    def expr(depth: int) -> str:
        text = term(depth)
        for _ in range(draw(st.integers(0, 3))):
            text += f"{sp()}{draw(st.sampled_from('+-'))}{sp()}{term(depth)}"
        return text

    return expr(0)


def test_grammar_and_regex_cannot_produce_lt() -> None:
    assert "<" not in CALC.grammar
    assert "<" not in CALC.manifest["result_regex"]
    CALC.check_cannot_produce_lt()


@PROPERTY_TIMEOUT
@property_settings(full=1_000, quick=60)
@given(text=model_input())
def test_model_grammar_inputs_are_accepted(guest: Guest, text: str) -> None:
    """Whatever the grammar lets a model write, the evaluator parses (no `syntax` error)."""
    assert CALC.grammar_accepts(text), text
    assert assert_agree(guest, text.encode())[1] != "syntax", text


@pytest.mark.parametrize(
    ("within", "over"),
    [
        ("1.5 * 1.5 * 1.5", "1.5 * 1.5 * 1.5 * 1.5"),
        ("1 + 2 + 3 + 4", "1 + 2 + 3 + 4 + 5"),
        ("((1))", "(((1)))"),
        ("2 ** (3 ** 2)", "2 ** 3 ** 2"),
        ("123456789012", "1234567890123"),
    ],
)
def test_model_grammar_is_bounded(guest: Guest, within: str, over: str) -> None:
    """A span cannot loop: the grammar takes each form up to its bound and refuses one more
    piece, which the evaluator itself would still accept."""
    assert CALC.grammar_accepts(within), within
    assert not CALC.grammar_accepts(over), over
    assert assert_agree(guest, over.encode())[1] != "syntax"


def test_grammar_rejects_what_the_model_may_not_write() -> None:
    for text in ("17 * 23 + 91", "(1.5 + 2) * -3", "2 ** -1", "999999999999.999999", "0.5"):
        assert CALC.grammar_accepts(text), text
    for text in ("1234567890123", "1.1234567", "01", ".5", "5.", "--1", "1  + 2", "(1", "1 +",
                 "1e5", "1<2", "1</calc>", " 1", "1 ", "2(3)", "- 1", "1//2"):
        assert not CALC.grammar_accepts(text), text


def test_result_regex_in_xgrammar_agrees_with_python_re(guest: Guest) -> None:
    """The regex means the same to XGrammar as to `re` (used by the differential tests)."""
    extra = ["-0.50", "01", "1.", ".5", "1e5", "--1", "1<", "+1", "0.0"]
    CALC.check_regex_agrees_with_python_re(guest, extra, minimum=101)


def test_grammar_compiles_for_the_real_tokenizer() -> None:
    """Compiled against SmolLM2's vocabulary, the tokens of the demo span walk the matcher."""
    CALC.check_tokens_walk("17 * 23 + 91")
