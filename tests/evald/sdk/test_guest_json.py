"""The SDK's guest JSON libraries (Zig ``evald_json``, C ``evald_json.h``, Rust
``evald_guest::json``, AssemblyScript ``evald-guest/json``), each held to Python's json.

One guest per language (``json_echo/LANG``, built here by the SDK's build with the real
compilers) reads one JSON value with its library and writes it back with its writer, numbers as
exact decimals where they fit. On every input all four must give what Python gives: the same
value, written compact, strings escaped as ``json.dumps`` does with ``<`` as ``\\u003c``,
decimals exact in plain notation; and for malformed input (truncated, trailing garbage, bad
escapes, lone surrogates, invalid UTF-8, nesting past 32) a ``syntax`` error, never a trap.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toolchains import require_toolchain, use_repository_asc

from evald.host import HostConfig, Limits, LoadedModule, WasmHost
from evald.sdk import MALFORMED_INPUTS, build_evaluator
from evaluators_wasm.reference import GuestError
from evaluators_wasm.reference.booking_policy import (
    JsonNumber,
    decimal_text,
    exact_decimal,
    parse_json,
)

ECHO = Path(__file__).resolve().parent / "json_echo"
LANGUAGES = ("zig", "c", "rust", "assemblyscript")
LIMITS = Limits(fuel=2_000_000_000)
Echo = Callable[[bytes], tuple[str, str]]


@pytest.fixture(scope="module")
def host() -> Iterator[WasmHost]:
    with WasmHost(HostConfig(epoch_tick_ms=0)) as wasm_host:
        yield wasm_host


@pytest.fixture(scope="module")
def echoes(host: WasmHost) -> dict[str, Echo]:
    """Each language's json_echo, built once (skipping a language without its compiler)."""
    use_repository_asc()
    built: dict[str, Echo] = {}
    for language in LANGUAGES:
        if language in ("rust", "assemblyscript"):
            require_toolchain(language)
        module = host.load(build_evaluator(ECHO / language), limits=LIMITS)
        built[language] = _runner(host, module)
    return built


def _runner(host: WasmHost, module: LoadedModule) -> Echo:
    def run(data: bytes) -> tuple[str, str]:
        outcome = host.evaluate(module, data, LIMITS)
        if outcome.error is not None:
            return "error", outcome.error.value
        return "value", outcome.value or ""

    return run


def canonical(value: Any) -> str:
    """What the writers write for a value the readers read."""
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, JsonNumber):
        exact = exact_decimal(value)
        return str(value) if exact is None else decimal_text(exact)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("<", "\\u003c")
    if isinstance(value, list):
        return "[" + ",".join(map(canonical, value)) + "]"
    return "{" + ",".join(f"{canonical(k)}:{canonical(v)}" for k, v in value.items()) + "}"


def expected(data: bytes) -> tuple[str, str]:
    try:
        return "value", canonical(parse_json(data))
    except GuestError as error:
        return "error", error.code


INPUTS: list[bytes] = [
    b"null",
    b"true",
    b" false ",
    b"0",
    b"-0",
    b"-12.50",
    b"1e2",
    b"1.5E+3",
    b"2.5e-3",
    b"1e-18",
    b"1e-19",
    b"123456789012345678",
    b"1234567890123456789",
    b"9223372036854775807",
    b"5e18",
    b"1e1000",
    b"1e1001",
    b'""',
    b'"plain"',
    b'"quote \\" backslash \\\\ slash \\/ \\b\\f\\n\\r\\t"',
    b'"\\u0000\\u001f\\u007f\\u00e9\\u20ac"',
    b'"\\ud834\\udd1e and \xf0\x9d\x84\x9e"',
    b'"<tag> & </tag>"',
    '"caf\u00e9 \u2028 \u65e5\u672c"'.encode(),
    b"[]",
    b"{}",
    b"[1, [2, [3, []]], {}]",
    b'{"age": 34, "components": [6500, 1200.5], "name": "Ana", "ok": true, "x": null}',
    b'{"nested": {"deeper": {"list": [{"a": 1}, {"b": [true, false]}]}}}',
    b'{"\\u0061ge": 1}',
    b"[" * 32 + b"]" * 32,
    b"[" * 33 + b"]" * 33,
    b'{"a":' * 32 + b"1" + b"}" * 32,
    *MALFORMED_INPUTS,
    b'"\\udd1e"',
    b'"\\ud834x"',
    b'"\\ud834\\u0041"',
    b'"\\u12"',
    b'"\\u+123"',
    b'"\\u1_23"',
    b'"\\u-123"',
    b'"\\U0041"',
    b"\xc3\x28",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xe0\x80\xaf",
    b"[1 2]",
    b"{1: 2}",
    b'{"a" : }',
    b"+1",
    b".5",
    b"1.e5",
    b"1e",
    b"0x10",
    b"Infinity",
    b"truex",
    b"[null, nul]",
]


def test_the_inputs_give_values_and_refusals() -> None:
    kinds = [expected(data)[0] for data in INPUTS]
    assert kinds.count("value") >= 30 and kinds.count("error") >= 40
    assert {expected(data)[1] for data in INPUTS if expected(data)[0] == "error"} == {"syntax"}


@pytest.mark.parametrize("language", LANGUAGES)
def test_each_library_reads_and_writes_as_python_does(
    echoes: dict[str, Echo], language: str
) -> None:
    differ = [
        (data, echoes[language](data), expected(data))
        for data in INPUTS
        if echoes[language](data) != expected(data)
    ]
    assert not differ, differ


def _dump(value: Any, ascii_only: bool, spaced: bool) -> str:
    comma, colon = (", ", ": ") if spaced else (",", ":")
    if isinstance(value, Decimal):
        return str(value)  # exact, and sometimes with an exponent (1E+2)
    if isinstance(value, list):
        return "[" + comma.join(_dump(v, ascii_only, spaced) for v in value) + "]"
    if isinstance(value, dict):
        members = (f"{json.dumps(k, ensure_ascii=ascii_only)}{colon}{_dump(v, ascii_only, spaced)}"
                   for k, v in value.items())  # fmt: skip
        return "{" + comma.join(members) + "}"
    return json.dumps(value, ensure_ascii=ascii_only)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.decimals(
        allow_nan=False, allow_infinity=False, places=4, min_value=-(10**9), max_value=10**9
    )
    | st.decimals(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=16,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=json_values, ascii_only=st.booleans(), spaced=st.booleans())
def test_the_libraries_agree_with_python_on_generated_documents(
    echoes: dict[str, Echo], value: Any, ascii_only: bool, spaced: bool
) -> None:
    data = _dump(value, ascii_only, spaced).encode()
    want = expected(data)
    assert want[0] == "value"
    for language, echo in echoes.items():
        assert echo(data) == want, language
