"""checksum: conformance cases, WASM-vs-reference differential tests, bombs and the grammar.

The conformance file (evaluators_wasm/conformance/checksum.jsonl) holds hand-written cases whose
expected values come from the standard algorithms (zlib's CRC-32, FIPS 180 SHA-256, the Luhn and
ISBN rules), not from either implementation. Hypothesis then checks that the WASM guest and the
Python reference agree — value or error code — on generated calls, mutated calls and garbage.

Every check that runs the guest runs it for the Zig module and for each port of checksum to
another language (evaluators_wasm/ports/: Rust, AssemblyScript); test_ports.py holds the ports
to the Zig module's messages too.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evaluators_wasm import PORTS
from tests.evaluators_wasm.support import (
    DEFAULT_LIMITS,
    PROPERTY_TIMEOUT,
    DefaultLimitsGuest,
    Evaluator,
    Guest,
    mutated,
    property_settings,
)

CHECKSUM = Evaluator("checksum", {"syntax", "domain", "too_large"}, compare_messages=False)
INPUT_CAP = DEFAULT_LIMITS.input_bytes
#: The standard module and its ports: each must pass every check of this file.
PORT_NAMES = tuple(name for name, (of, _) in PORTS.items() if of == "checksum")
IMPLEMENTATIONS = ("checksum", *PORT_NAMES)


@pytest.fixture(params=IMPLEMENTATIONS)
def module_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def guest(guest: Guest, module_name: str) -> Guest:
    """The conftest's guest, running the implementation under test whatever name it is given."""
    return lambda _name, data: guest(module_name, data)


@pytest.fixture
def default_limits_guest(
    default_limits_guest: DefaultLimitsGuest, module_name: str
) -> DefaultLimitsGuest:
    return lambda _name, data: default_limits_guest(module_name, data)


@pytest.mark.parametrize("case", CHECKSUM.cases, ids=CHECKSUM.case_id)
def test_conformance(case: dict[str, Any], guest: Guest) -> None:
    CHECKSUM.check_case(guest, case)


def test_conformance_covers_every_function_and_error() -> None:
    inputs = " ".join(str(c.get("input", "")) for c in CHECKSUM.cases)
    for function in FUNCTIONS:
        assert f"{function}(" in inputs
    assert CHECKSUM.case_codes() == CHECKSUM.error_codes


# --- differential: generated inputs -------------------------------------------------------

FUNCTIONS = ("crc32", "sha256", "luhn_digit", "luhn_valid", "isbn10_digit", "isbn10_valid",
             "isbn13_digit", "isbn13_valid")
ESCAPES = st.sampled_from(['\\"', "\\\\", "\\n", "\\t", "\\u00e9", "\\u20AC", "\\u003c", "\\u0000",
                           "\\ud800", "\\u12", "\\x41", "\\r", "\\"])
LITERAL_PIECE = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_characters='"\\'), max_size=12),
    ESCAPES,
)
DIGIT_PIECE = st.one_of(
    st.text("0123456789", min_size=1, max_size=13),
    st.sampled_from([" ", "-", "X", "x", "a", ".", "\\u0031", "\\n"]),
)
SPACE = st.text(" \t\n\r", max_size=2)


@st.composite
def calls(draw: st.DrawFn) -> str:
    function = draw(st.sampled_from(FUNCTIONS))
    piece = LITERAL_PIECE if function in ("crc32", "sha256") else DIGIT_PIECE
    body = "".join(draw(st.lists(piece, max_size=8)))
    ws = [draw(SPACE) for _ in range(5)]
    return f'{ws[0]}{function}{ws[1]}({ws[2]}"{body}"{ws[3]}){ws[4]}'


@st.composite
def isbn_like(draw: st.DrawFn) -> str:
    """Digit strings of the lengths the ISBN rules take, so both true and false results occur."""
    function = draw(st.sampled_from(FUNCTIONS[2:]))
    n = {"isbn10_digit": 9, "isbn10_valid": 10, "isbn13_digit": 12, "isbn13_valid": 13}.get(
        function, draw(st.integers(1, 20))
    )
    digits = draw(st.text("0123456789", min_size=n, max_size=n))
    if function == "isbn10_valid" and draw(st.booleans()):
        digits = digits[:-1] + draw(st.sampled_from("Xx"))
    return f'{function}("{digits}")'


mutated_call = mutated(
    st.one_of(calls(), isbn_like()).map(str.encode),
    st.one_of(st.sampled_from(list(b'"\\()uX- 0a\xc3\xff\x80')), st.integers(0, 255)).map(
        lambda byte: bytes([byte])),
)


DIFF_SETTINGS = property_settings()


@PROPERTY_TIMEOUT
@DIFF_SETTINGS
@given(text=st.one_of(calls(), isbn_like()))
def test_differential_generated(guest: Guest, text: str) -> None:
    CHECKSUM.assert_agree(guest, text.encode("utf-8"))


@PROPERTY_TIMEOUT
@DIFF_SETTINGS
@given(data=mutated_call)
def test_differential_mutated(guest: Guest, data: bytes) -> None:
    CHECKSUM.assert_agree(guest, data)


@PROPERTY_TIMEOUT
@DIFF_SETTINGS
@given(data=st.one_of(st.binary(max_size=40), st.builds(lambda b: b'crc32("' + b + b'")',
                                                         st.binary(max_size=20))))
def test_differential_garbage(guest: Guest, data: bytes) -> None:
    CHECKSUM.assert_agree(guest, data)


@PROPERTY_TIMEOUT
@DIFF_SETTINGS
@given(payload=st.binary(max_size=64))
def test_hashes_match_zlib_and_hashlib(guest: Guest, payload: bytes) -> None:
    """Any byte string, written with \\uXXXX escapes where not raw-writable, hashes like the
    standard libraries hash its UTF-8 bytes (the escapes decode to exactly those bytes)."""
    text = payload.decode("utf-8", errors="replace")
    literal = "".join(f"\\u{ord(c):04x}" if c in '"\\' or ord(c) < 32 else c for c in text)
    raw = text.encode("utf-8")
    assert guest(CHECKSUM.name, f'crc32("{literal}")'.encode())[0] == f"{zlib.crc32(raw):08x}"
    sha256 = guest(CHECKSUM.name, f'sha256("{literal}")'.encode())[0]
    assert sha256 == hashlib.sha256(raw).hexdigest()


# --- bombs: typed answers within the host's default limits --------------------------------

def _fill(prefix: bytes, unit: bytes, suffix: bytes) -> bytes:
    """``prefix + unit * k + suffix`` as close to the 1 MiB input cap as whole units allow."""
    k = (INPUT_CAP - len(prefix) - len(suffix)) // len(unit)
    return prefix + unit * k + suffix


BOMBS = {
    "crc32 of 1 MiB ASCII": _fill(b'crc32("', b"a", b'")'),
    "sha256 of 1 MiB ASCII": _fill(b'sha256("', b"a", b'")'),
    "sha256 of 1 MiB of 2-byte characters": _fill(b'sha256("', "é".encode(), b'")'),
    "sha256 of 1 MiB of 4-byte characters": _fill(b'sha256("', "😀".encode(), b'")'),
    "sha256 of 1 MiB of \\u escapes": _fill(b'sha256("', b"\\u00e9", b'")'),
    "sha256 of 1 MiB of \\\" escapes": _fill(b'sha256("', b'\\"', b'")'),
    "crc32 of 1 MiB of \\n escapes": _fill(b'crc32("', b"\\n", b'")'),
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_megabyte_hash_within_default_fuel(default_limits_guest: DefaultLimitsGuest,
                                           name: str) -> None:
    data = BOMBS[name]
    assert len(data) > INPUT_CAP - 8
    value = CHECKSUM.check_bomb(default_limits_guest, data, None)[0]
    assert value is not None


BOMB_ERRORS = [
    (_fill(b'luhn_digit("', b"1", b'")'), "too_large"),
    (_fill(b'isbn13_valid("', b"7", b'")'), "too_large"),
    (_fill(b'luhn_digit("', b"12a", b'")'), "syntax"),
    (_fill(b'crc32("', b"a", b""), "syntax"),  # unterminated after a megabyte
    (_fill(b'crc32("', b"\xc3", b'")'), "syntax"),  # a megabyte of broken UTF-8
    (_fill(b"", b"crc32", b""), "syntax"),
    (_fill(b"", b" ", b""), "syntax"),
]


@pytest.mark.parametrize("data,code", BOMB_ERRORS)
def test_bombs_typed_error(default_limits_guest: DefaultLimitsGuest, data: bytes,
                           code: str) -> None:
    CHECKSUM.check_bomb(default_limits_guest, data, code)


def test_input_of_exactly_the_capacity_is_accepted(guest: Guest) -> None:
    data = _fill(b'crc32("', b"z", b'")')
    data = data + b" " * (INPUT_CAP - len(data))
    assert len(data) == INPUT_CAP
    assert guest(CHECKSUM.name, data)[0] == f"{zlib.crc32(b'z' * (data.count(b'z'))):08x}"


# --- the ports: the Zig module's outcome, message included, byte for byte ---------------------


@PROPERTY_TIMEOUT
@DIFF_SETTINGS
@pytest.mark.parametrize("port", PORT_NAMES)
@given(data=st.one_of(
    st.one_of(calls(), isbn_like()).map(str.encode), mutated_call, st.binary(max_size=40)))
def test_ports_agree_with_the_zig_module_byte_for_byte(
    named_guest: Guest, port: str, data: bytes
) -> None:
    """Value, error code and error message: the same bytes as the Zig module's."""
    assert named_guest(port, data) == named_guest("checksum", data), data[:300]


@pytest.mark.parametrize("port", PORT_NAMES)
def test_ports_give_the_zig_messages_on_every_case_and_bomb(named_guest: Guest, port: str) -> None:
    inputs = [CHECKSUM.data(case) for case in CHECKSUM.cases] + list(BOMBS.values())
    inputs += [data for data, _ in BOMB_ERRORS]
    for data in inputs:
        assert named_guest(port, data) == named_guest("checksum", data), data[:300]


# --- the grammar a model writes in ---------------------------------------------------------

GRAMMAR_ACCEPTS = [
    'crc32("hello")', 'sha256("a \\"quoted\\" \\u00e9 word")', 'crc32( "" )',
    'luhn_digit("7992739871")', 'luhn_valid("4111 1111 1111 1111")', 'isbn10_digit("030640615")',
    'isbn10_valid("0-8044-2957-X")', 'isbn13_digit("978-0-306-40615")',
    'isbn13_valid("9780306406157")',
]
GRAMMAR_REJECTS = [
    'crc32("<")', 'crc32("a\nb")', 'luhn_digit("12a")', 'luhn_digit("")', 'isbn13_valid("978X")',
    'md5("a")', 'crc32("\\x41")', 'luhn_digit("' + "1" * 20 + '")',
]


@pytest.mark.parametrize("text", GRAMMAR_ACCEPTS)
def test_grammar_accepts_and_guest_evaluates(guest: Guest, text: str) -> None:
    CHECKSUM.check_model_example(guest, text)


@pytest.mark.parametrize("text", GRAMMAR_REJECTS)
def test_grammar_rejects(text: str) -> None:
    assert not CHECKSUM.grammar_accepts(text)


def test_result_regex_compiles() -> None:
    assert CHECKSUM.compiled_regex is not None
    assert CHECKSUM.regex_accepts("0" * 64) and not CHECKSUM.regex_accepts("0" * 63)


def test_grammar_compiles_for_the_real_tokenizer() -> None:
    """Compiled against SmolLM2's vocabulary, the tokens of a real span walk the matcher."""
    CHECKSUM.check_tokens_walk('sha256("a \\"quoted\\" \\u00e9 word")')


def test_grammar_and_regex_never_produce_a_tag_opener() -> None:
    CHECKSUM.check_cannot_produce_lt()
