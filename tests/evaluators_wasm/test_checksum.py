"""checksum: conformance cases, WASM-vs-reference differential tests, bombs and the grammar.

The conformance file (evaluators_wasm/conformance/checksum.jsonl) holds hand-written cases whose
expected values come from the standard algorithms (zlib's CRC-32, FIPS 180 SHA-256, the Luhn and
ISBN rules), not from either implementation. Hypothesis then checks that the WASM guest and the
Python reference agree — value or error code — on generated calls, mutated calls and garbage.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import wasmtime
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evaluators_wasm import SOURCE_DIR, wasm_path
from evaluators_wasm.reference import GuestError
from evaluators_wasm.reference.checksum import evaluate as reference

NAME = "checksum"
ROOT = Path(__file__).resolve().parents[2]
CASES: list[dict[str, Any]] = [
    json.loads(line)
    for line in (ROOT / "evaluators_wasm" / "conformance" / f"{NAME}.jsonl")
    .read_text(encoding="utf-8")
    .splitlines()
    if line.strip()
]
MANIFEST = json.loads((SOURCE_DIR / NAME / "manifest.json").read_text(encoding="utf-8"))
RESULT_RE = re.compile(MANIFEST["result_regex"])
FULL = os.environ.get("EVALD_FULL") == "1"
EXAMPLES = 10_000 if FULL else 200
#: The host's default per-call fuel (evald's Limits.fuel); bombs must finish within it.
DEFAULT_FUEL = 200_000_000
INPUT_CAP = 1 << 20

Outcome = tuple[str | None, str | None, str]
Guest = Callable[[str, bytes], Outcome]


def case_input(case: dict[str, Any]) -> bytes:
    if "input_b64" in case:
        return base64.b64decode(case["input_b64"])
    return str(case["input"]).encode("utf-8")


def run_reference(data: bytes) -> tuple[str | None, str | None]:
    try:
        return reference(data), None
    except GuestError as err:
        return None, err.code


def check_value(value: str) -> None:
    assert RESULT_RE.fullmatch(value), f"{value!r} does not match the result regex"
    assert "<" not in value


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c.get("note") or c.get("input"))[:60])
def test_conformance_wasm(case: dict[str, Any], guest: Guest) -> None:
    value, code, message = guest(NAME, case_input(case))
    if "error" in case:
        assert (value, code) == (None, case["error"]), message
        assert message, "every error carries a message"
    else:
        assert (value, code) == (case["value"], None), message
        check_value(value)


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c.get("note") or c.get("input"))[:60])
def test_conformance_reference(case: dict[str, Any]) -> None:
    value, code = run_reference(case_input(case))
    if "error" in case:
        assert (value, code) == (None, case["error"])
    else:
        assert (value, code) == (case["value"], None)


def test_conformance_covers_every_function_and_error() -> None:
    inputs = " ".join(str(c.get("input", "")) for c in CASES)
    for function in ("crc32", "sha256", "luhn_digit", "luhn_valid", "isbn10_digit",
                     "isbn10_valid", "isbn13_digit", "isbn13_valid"):
        assert f"{function}(" in inputs
    assert {c["error"] for c in CASES if "error" in c} == {"syntax", "domain", "too_large"}


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


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.one_of(calls(), isbn_like())).encode("utf-8"))
    for _ in range(draw(st.integers(1, 3))):
        pos = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["insert", "delete", "replace"]))
        special = st.sampled_from(list(b'"\\()uX- 0a\xc3\xff\x80'))
        byte = draw(st.one_of(special, st.integers(0, 255)))
        if action == "insert":
            data.insert(pos, byte)
        elif pos < len(data):
            if action == "delete":
                del data[pos]
            else:
                data[pos] = byte
    return bytes(data)


def assert_agree(guest: Guest, data: bytes) -> None:
    value, code, message = guest(NAME, data)
    assert code is None or not code.startswith("trap"), f"guest trapped on {data!r}: {message}"
    assert (value, code) == run_reference(data), f"disagreement on {data!r}"
    if value is not None:
        check_value(value)


DIFF_SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture])


@DIFF_SETTINGS
@given(text=st.one_of(calls(), isbn_like()))
def test_differential_generated(guest: Guest, text: str) -> None:
    assert_agree(guest, text.encode("utf-8"))


@DIFF_SETTINGS
@given(data=mutated())
def test_differential_mutated(guest: Guest, data: bytes) -> None:
    assert_agree(guest, data)


@DIFF_SETTINGS
@given(data=st.one_of(st.binary(max_size=40), st.builds(lambda b: b'crc32("' + b + b'")',
                                                         st.binary(max_size=20))))
def test_differential_garbage(guest: Guest, data: bytes) -> None:
    assert_agree(guest, data)


@DIFF_SETTINGS
@given(payload=st.binary(max_size=64))
def test_hashes_match_zlib_and_hashlib(guest: Guest, payload: bytes) -> None:
    """Any byte string, written with \\uXXXX escapes where not raw-writable, hashes like the
    standard libraries hash its UTF-8 bytes (the escapes decode to exactly those bytes)."""
    text = payload.decode("utf-8", errors="replace")
    literal = "".join(f"\\u{ord(c):04x}" if c in '"\\' or ord(c) < 32 else c for c in text)
    raw = text.encode("utf-8")
    assert guest(NAME, f'crc32("{literal}")'.encode())[0] == f"{zlib.crc32(raw):08x}"
    assert guest(NAME, f'sha256("{literal}")'.encode())[0] == hashlib.sha256(raw).hexdigest()


# --- bombs: typed answers within the host's default limits --------------------------------

_ENGINE_CONFIG = wasmtime.Config()
_ENGINE_CONFIG.consume_fuel = True
_ENGINE = wasmtime.Engine(_ENGINE_CONFIG)


def run_with_default_fuel(data: bytes) -> tuple[str | None, str | None, int]:
    """Runs the guest with the daemon's default fuel budget; returns (value, code, fuel used)."""
    store = wasmtime.Store(_ENGINE)
    store.set_fuel(DEFAULT_FUEL)
    store.set_limits(memory_size=64 * 2**20)
    module = wasmtime.Module.from_file(_ENGINE, str(wasm_path(NAME)))
    exports = wasmtime.Instance(store, module, []).exports(store)
    exports["memory"].write(store, data, exports["evald_input_ptr"](store))
    result = exports["evald_eval"](store, len(data))  # a trap (out of fuel) fails the test
    out = exports["evald_output_ptr"](store)
    text = bytes(exports["memory"].read(store, out, out + abs(result))).decode("utf-8")
    used = DEFAULT_FUEL - store.get_fuel()
    if result >= 0:
        return text, None, used
    return None, text.partition(":")[0], used


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
def test_megabyte_hash_within_default_fuel(name: str) -> None:
    data = BOMBS[name]
    assert len(data) > INPUT_CAP - 8
    value, code, used = run_with_default_fuel(data)
    assert code is None and value is not None
    assert (value, None) == run_reference(data)
    assert used < DEFAULT_FUEL


@pytest.mark.parametrize("data,code", [
    (_fill(b'luhn_digit("', b"1", b'")'), "too_large"),
    (_fill(b'isbn13_valid("', b"7", b'")'), "too_large"),
    (_fill(b'luhn_digit("', b"12a", b'")'), "syntax"),
    (_fill(b'crc32("', b"a", b""), "syntax"),  # unterminated after a megabyte
    (_fill(b'crc32("', b"\xc3", b'")'), "syntax"),  # a megabyte of broken UTF-8
    (_fill(b"", b"crc32", b""), "syntax"),
    (_fill(b"", b" ", b""), "syntax"),
])
def test_bombs_typed_error(data: bytes, code: str) -> None:
    value, got, _ = run_with_default_fuel(data)
    assert (value, got) == (None, code)
    assert run_reference(data) == (None, code)


def test_input_of_exactly_the_capacity_is_accepted(guest: Guest) -> None:
    data = _fill(b'crc32("', b"z", b'")')
    data = data + b" " * (INPUT_CAP - len(data))
    assert len(data) == INPUT_CAP
    assert guest(NAME, data)[0] == f"{zlib.crc32(b'z' * (data.count(b'z'))):08x}"


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


@pytest.fixture(scope="module")
def compiled_grammar() -> Any:
    xgr = pytest.importorskip("xgrammar")
    from engine_adapter._model_files import load_tokenizer

    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer())
    grammar = xgr.Grammar.from_ebnf((SOURCE_DIR / NAME / "grammar.ebnf").read_text("utf-8"))
    xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.from_regex(MANIFEST["result_regex"]))
    return xgr.GrammarCompiler(info).compile_grammar(grammar)


def _grammar_accepts(compiled: Any, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    return bool(matcher.accept_string(text)) and bool(matcher.is_completed())


@pytest.mark.parametrize("text", GRAMMAR_ACCEPTS)
def test_grammar_accepts_and_guest_evaluates(compiled_grammar: Any, guest: Guest,
                                             text: str) -> None:
    assert _grammar_accepts(compiled_grammar, text)
    value, code, message = guest(NAME, text.encode())
    assert code is None, message
    assert value is not None
    check_value(value)


@pytest.mark.parametrize("text", GRAMMAR_REJECTS)
def test_grammar_rejects(compiled_grammar: Any, text: str) -> None:
    assert not _grammar_accepts(compiled_grammar, text)


def test_grammar_and_regex_never_produce_a_tag_opener() -> None:
    grammar = (SOURCE_DIR / NAME / "grammar.ebnf").read_text("utf-8")
    assert "<" not in grammar.replace("[^\"\\\\<\\n]", "")  # only inside the excluded class
    assert "<" not in MANIFEST["result_regex"]
