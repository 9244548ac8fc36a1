"""Regression tests for the hardening ``evald fuzz`` found, each against the real daemon.

1. A request whose bytes are not a valid protobuf message got grpc's untyped ``UNKNOWN`` status
   (unary) or ``internal`` (stream); now both are ``invalid_argument`` with a message.
2. Tables were not capped: one ``table.fill``/``table.grow`` (a single instruction, so neither
   fuel nor the epoch stops it) committed 400 MB and ran a second past a 20 ms deadline. Stores
   now hold at most ``MAX_TABLES`` tables of ``MAX_TABLE_ELEMENTS`` elements.
3. Compilation cannot be interrupted, and a 1.2 MB module of 60,000 tiny functions took a minute
   of CPU at registration: the validator caps functions and code bytes before compiling.
"""

from __future__ import annotations

import grpc
import pytest
import wasmtime
from daemon_harness import TOKENS, Daemon, assert_still_serving, module, outcome

from evald.client import CallError, Client
from evald.contract import (
    ERROR_CODE_METADATA_KEY,
    MANIFEST_SECTION,
    EvaldError,
    append_custom_section,
)
from evald.host import MAX_CODE_BYTES, MAX_FUNCTIONS, MAX_TABLE_ELEMENTS, validate_module
from evald.host._wasm_binary import parse_module
from evald.testing import arg, manifest_bytes, wat_text

_SERVICE = "/evald.v1.Evaluator"
#: Not a protobuf message: a field key of wire type 7, which does not exist.
_CORRUPT = b"\x0f\xff\xff\xff"


def _with_manifest(wat: str, name: str) -> bytes:
    wasm = bytes(wasmtime.wat2wasm(wat))
    manifest = manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1")
    return append_custom_section(wasm, MANIFEST_SECTION, manifest)


def _metadata(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def _error_code(error: grpc.RpcError) -> str | None:
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == ERROR_CODE_METADATA_KEY:
            return str(value)
    return None


@pytest.mark.parametrize(
    "method", ["Evaluate", "EvaluateBatch", "ListEvaluators", "RegisterEvaluator"]
)
def test_a_corrupt_unary_message_is_invalid_argument(daemon: Daemon, method: str) -> None:
    with grpc.insecure_channel(daemon.target) as channel:
        call = channel.unary_unary(f"{_SERVICE}/{method}")
        with pytest.raises(grpc.RpcError) as refused:
            call(_CORRUPT, timeout=10, metadata=_metadata("beta"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert _error_code(refused.value) == "invalid_argument"
    assert "not a valid evald.v1." in refused.value.details()  # type: ignore[attr-defined]
    assert_still_serving(daemon)


def test_a_string_field_that_is_not_utf8_is_invalid_argument(daemon: Daemon) -> None:
    # field 1 (evaluator), length 2, bytes ff fe: proto3 strings must be UTF-8
    with grpc.insecure_channel(daemon.target) as channel:
        call = channel.unary_unary(f"{_SERVICE}/Evaluate")
        with pytest.raises(grpc.RpcError) as refused:
            call(b"\x0a\x02\xff\xfe", timeout=10, metadata=_metadata("beta"))
    assert _error_code(refused.value) == "invalid_argument"


def test_a_corrupt_message_without_a_token_is_still_refused_for_the_token(daemon: Daemon) -> None:
    with grpc.insecure_channel(daemon.target) as channel:
        call = channel.unary_unary(f"{_SERVICE}/Evaluate")
        with pytest.raises(grpc.RpcError) as refused:
            call(_CORRUPT, timeout=10, metadata=(("authorization", "Bearer wrong"),))
    assert _error_code(refused.value) == "permission_denied"


def test_a_corrupt_stream_message_is_invalid_argument_not_internal(daemon: Daemon) -> None:
    good = b"\x0a\x0a\x0a\x04calc\x12\x021+"  # one item: calc "1+"
    with grpc.insecure_channel(daemon.target) as channel:
        call = channel.stream_stream(f"{_SERVICE}/EvaluateStream")
        with pytest.raises(grpc.RpcError) as refused:
            list(call(iter([good, _CORRUPT]), timeout=10, metadata=_metadata("beta")))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert _error_code(refused.value) == "invalid_argument"
    assert_still_serving(daemon)


@pytest.fixture(scope="module")
def limits_client(daemon: Daemon) -> Client:
    return daemon.client("limits")


def test_a_table_declared_above_the_cap_is_refused(limits_client: Client) -> None:
    at_cap = _with_manifest(wat_text("table_fill", MAX_TABLE_ELEMENTS), "table_at_cap")
    info = limits_client.register(at_cap)
    assert info.name == "table_at_cap"
    response = limits_client.evaluate("table_at_cap", b"x")
    assert (outcome(response), response.value) == ("ok", "ok")

    over = _with_manifest(wat_text("table_fill", MAX_TABLE_ELEMENTS + 1), "table_over_cap")
    with pytest.raises(CallError) as refused:
        limits_client.register(over)
    assert refused.value.code is not None and refused.value.code.value == "invalid_module"
    assert "table" in refused.value.message


def test_table_grow_past_the_cap_is_refused_inside_the_guest(
    daemon: Daemon, limits_client: Client
) -> None:
    limits_client.register(_with_manifest(wat_text("table_grow"), "table_grower"))
    # the module's table starts with 1 element
    granted = limits_client.evaluate("table_grower", arg(MAX_TABLE_ELEMENTS - 1))
    assert (outcome(granted), granted.value) == ("ok", "ok")
    refused = limits_client.evaluate("table_grower", arg(MAX_TABLE_ELEMENTS))
    assert (outcome(refused), refused.value) == ("ok", "no")
    bomb = limits_client.evaluate("table_grower", arg(60_000_000))
    assert (outcome(bomb), bomb.value) == ("ok", "no")
    assert_still_serving(daemon)


def test_a_second_table_is_refused(limits_client: Client) -> None:
    tables = " ".join(f"(table $extra{i} 1 funcref)" for i in range(4))
    wasm = _with_manifest(wat_text("table_grow", extra=tables), "five_tables")
    with pytest.raises(CallError) as refused:
        limits_client.register(wasm)
    assert refused.value.code is not None and refused.value.code.value == "invalid_module"


def _functions(count: int) -> str:
    return "".join(f"(func (result i32) (i32.const {i}))" for i in range(count))


def test_function_count_cap_n_and_n_plus_one() -> None:
    # the validator alone (no compilation): the module itself defines 6 functions
    fits = bytes(
        append_custom_section(
            wasmtime.wat2wasm(wat_text(extra=_functions(MAX_FUNCTIONS - 6))),
            MANIFEST_SECTION,
            manifest_bytes(),
        )
    )
    assert len(parse_module(fits).function_types) == MAX_FUNCTIONS
    assert validate_module(fits).name == "probe"
    over = bytes(
        append_custom_section(
            wasmtime.wat2wasm(wat_text(extra=_functions(MAX_FUNCTIONS - 5))),
            MANIFEST_SECTION,
            manifest_bytes(),
        )
    )
    with pytest.raises(EvaldError) as refused:
        validate_module(over)
    assert f"at most {MAX_FUNCTIONS}" in refused.value.message


def test_the_daemon_refuses_a_compile_bomb_before_compiling_it(
    daemon: Daemon, limits_client: Client
) -> None:
    bomb = _with_manifest(wat_text(extra=_functions(MAX_FUNCTIONS)), "compile_bomb")
    with pytest.raises(CallError) as refused:
        limits_client.register(bomb)
    assert refused.value.code is not None and refused.value.code.value == "invalid_module"
    assert "functions" in refused.value.message
    assert_still_serving(daemon)


def _code_bytes(wasm: bytes) -> int:
    code = parse_module(wasm).section(10)
    assert code is not None
    return code.end - code.content_start


def _nops_module(nops: int) -> bytes:
    return bytes(
        append_custom_section(
            wasmtime.wat2wasm(wat_text(extra=f"(func {'nop ' * nops})")),
            MANIFEST_SECTION,
            manifest_bytes(),
        )
    )


def test_code_size_cap_n_and_n_plus_one() -> None:
    base = _code_bytes(_nops_module(MAX_CODE_BYTES - 200_000))
    nops = MAX_CODE_BYTES - 200_000 + (MAX_CODE_BYTES - base)
    fits = _nops_module(nops)
    if _code_bytes(fits) != MAX_CODE_BYTES:  # a LEB128 length grew by a byte
        fits = _nops_module(nops - (_code_bytes(fits) - MAX_CODE_BYTES))
    assert _code_bytes(fits) == MAX_CODE_BYTES
    assert validate_module(fits).name == "probe"
    over = _nops_module(nops + 1)
    assert _code_bytes(over) == MAX_CODE_BYTES + 1
    with pytest.raises(EvaldError) as refused:
        validate_module(over)
    assert "bytes of code" in refused.value.message


def test_an_ordinary_module_is_unaffected(limits_client: Client) -> None:
    limits_client.register(module("echo", "hardening_echo"))
    response = limits_client.evaluate("hardening_echo", b"hello")
    assert (outcome(response), response.value) == ("ok", "hello")
