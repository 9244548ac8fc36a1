"""Output handling, trap mapping and load-time refusals of the host."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest

from evald.contract import GUEST_ERROR_CODES, ErrorCode, EvaldError
from evald.host import HostConfig, Limits, LoadedModule, WasmHost, _engine
from evald.testing import guest
from evaluators_wasm import wasm_path

OUT_CAP = 4096


@pytest.fixture(scope="module")
def host() -> Iterator[WasmHost]:
    with WasmHost() as wasm_host:
        yield wasm_host


@pytest.fixture(scope="module")
def echo(host: WasmHost) -> LoadedModule:
    return host.load(guest("echo"))


def test_echo_and_the_empty_value(host: WasmHost, echo: LoadedModule) -> None:
    outcome = host.evaluate(echo, "17 \u00d7 23".encode(), Limits())
    assert (outcome.value, outcome.error, outcome.message) == ("17 \u00d7 23", None, "")
    assert outcome.ok and outcome.fuel_used > 0 and outcome.elapsed_us >= 0
    assert host.evaluate(echo, b"", Limits()).value == ""


def test_load_reports_the_module(host: WasmHost, echo: LoadedModule) -> None:
    wasm = guest("echo")
    assert echo.manifest.name == "probe" and echo.size_bytes == len(wasm)
    assert len(echo.sha256) == 64
    assert (echo.input_cap, echo.output_cap) == (4096, OUT_CAP)


@pytest.mark.parametrize("code", sorted(GUEST_ERROR_CODES, key=lambda c: c.value))
def test_each_guest_error_code_with_its_message(host: WasmHost, code: ErrorCode) -> None:
    module = host.load(guest("payload", (f"{code.value}:what went wrong".encode(), True)))
    outcome = host.evaluate(module, b"", Limits())
    assert (outcome.value, outcome.error, outcome.message) == (None, code, "what went wrong")


def test_a_bare_code_gets_a_default_message(host: WasmHost) -> None:
    module = host.load(guest("payload", (b"division_by_zero", True)))
    outcome = host.evaluate(module, b"", Limits())
    assert outcome.error is ErrorCode.DIVISION_BY_ZERO
    assert outcome.message == "probe: division_by_zero"


def test_a_long_guest_message_is_cut(host: WasmHost) -> None:
    module = host.load(guest("payload", (b"domain:" + b"m" * 1500, True)))
    outcome = host.evaluate(module, b"", Limits())
    assert (outcome.error, outcome.message) == (ErrorCode.DOMAIN, "m" * 1000)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b"unknown_thing:x", "unknown code 'unknown_thing'"),
        (b"fuel_exhausted:guests cannot claim host codes", "unknown code 'fuel_exhausted'"),
        (b"SYNTAX:upper case", "unknown code 'SYNTAX'"),
        (b"syntax:\xff", "not UTF-8"),
    ],
)
def test_malformed_error_payloads_are_guest_faults(
    host: WasmHost, payload: bytes, expected: str
) -> None:
    module = host.load(guest("payload", (payload, True)))
    outcome = host.evaluate(module, b"", Limits())
    assert outcome.error is ErrorCode.GUEST_FAULT and expected in outcome.message


def test_a_value_that_is_not_utf8_is_a_guest_fault(host: WasmHost) -> None:
    module = host.load(guest("payload", (b"ok\xc3(", False)))
    outcome = host.evaluate(module, b"", Limits())
    assert outcome.error is ErrorCode.GUEST_FAULT and "not UTF-8" in outcome.message


@pytest.mark.parametrize("result", [OUT_CAP + 1, -(OUT_CAP + 1), -(2**31), 2**31 - 1])
def test_out_of_range_lengths_are_guest_faults(host: WasmHost, result: int) -> None:
    module = host.load(guest("return", result))
    outcome = host.evaluate(module, b"", Limits())
    assert outcome.error is ErrorCode.GUEST_FAULT
    assert f"returned {result}" in outcome.message


def test_lengths_at_the_capacity_are_fine(host: WasmHost) -> None:
    module = host.load(guest("return", OUT_CAP))
    outcome = host.evaluate(module, b"", Limits())
    assert outcome.value == "\0" * OUT_CAP  # an untouched buffer reads as zero bytes


@pytest.mark.parametrize(
    ("kind", "name"), [("trap", "unreachable"), ("oob", "memory out of bounds")]
)
def test_traps_are_mapped_by_code(host: WasmHost, echo: LoadedModule, kind: str, name: str) -> None:
    module = host.load(guest(kind))
    outcome = host.evaluate(module, b"", Limits())
    assert outcome.error is ErrorCode.GUEST_FAULT
    assert outcome.message == f"evaluator probe trapped: {name}"
    assert host.evaluate(echo, b"next", Limits()).value == "next"


def load_refused(host: WasmHost, wasm: bytes, limits: Limits | None = None) -> str:
    with pytest.raises(EvaldError) as caught:
        host.load(wasm, limits=limits or Limits())
    assert caught.value.code is ErrorCode.INVALID_MODULE
    return caught.value.message


def test_a_start_function_that_loops_is_refused_by_fuel(host: WasmHost) -> None:
    message = load_refused(host, guest("echo", start="(loop $l (br $l))"))
    assert "start function" in message and "fuel" in message


def test_a_start_function_that_loops_is_refused_by_the_load_deadline() -> None:
    config = HostConfig(load_fuel=2**62, load_deadline_ms=50)
    with WasmHost(config) as host:
        message = load_refused(host, guest("echo", start="(loop $l (br $l))"))
        assert "start function" in message and "deadline" in message


def test_a_start_function_that_traps_is_refused(host: WasmHost) -> None:
    assert "trapped: unreachable" in load_refused(host, guest("echo", start="(unreachable)"))


def test_a_short_start_function_is_fine(host: WasmHost) -> None:
    module = host.load(guest("echo", start="(drop (i32.const 1))"))
    assert host.evaluate(module, b"s", Limits()).value == "s"


def test_the_abi_version_must_be_1(host: WasmHost) -> None:
    message = load_refused(host, guest("echo", abi_version=2))
    assert "evald_abi_version() returned 2" in message


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"in_ptr": 70000}, "input buffer [70000, 74096)"),
        ({"in_cap": 0}, "at least one byte"),
        ({"out_cap": 0}, "at least one byte"),
    ],
)
def test_buffers_must_lie_inside_memory(
    host: WasmHost, options: dict[str, int], expected: str
) -> None:
    assert expected in load_refused(host, guest("echo", **options))


def test_structural_problems_are_refused_at_load(host: WasmHost) -> None:
    assert "imports env.f" in load_refused(host, guest("echo", imports='(import "env" "f" (func))'))
    assert "does not export evald_eval" in load_refused(host, guest("echo", omit=("evald_eval",)))
    assert "not a WebAssembly module" in load_refused(host, b"print('hello')")
    assert "lacks the field(s) name" in load_refused(host, guest("echo", manifest=b'{"abi": 1}'))


def test_a_module_from_another_host_is_an_internal_error_not_a_crash(echo: LoadedModule) -> None:
    with WasmHost() as other:
        outcome = other.evaluate(echo, b"x", Limits())
        assert outcome.error is ErrorCode.INTERNAL


def test_evaluate_after_close_is_unavailable() -> None:
    host = WasmHost()
    module = host.load(guest("echo"))
    host.close()
    outcome = host.evaluate(module, b"x", Limits())
    assert outcome.error is ErrorCode.UNAVAILABLE


def test_a_standard_evaluator_runs_on_the_host(host: WasmHost) -> None:
    path = wasm_path("calc")
    if not path.exists():
        pytest.skip("calc.wasm is not built")
    calc = host.load(path.read_bytes())
    assert calc.grow_observed  # the rewrite reads a real Zig module
    outcome = host.evaluate(calc, b"17 * 23 + 91", Limits())
    assert (outcome.value, outcome.error) == ("482", None)
    assert host.evaluate(calc, b"1 / 0", Limits()).error is ErrorCode.DIVISION_BY_ZERO


def python_tickers() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "evald-epoch-ticker")


def native_tickers() -> int:
    """Native ticker threads alive (they are not Python threads)."""
    assert _engine._NATIVE is not None, _engine._NATIVE_MISSING
    return int(_engine._NATIVE.live())


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_close_and_dropping_the_host_stop_the_ticker_thread(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not native:
        monkeypatch.setattr(_engine, "_NATIVE", None)
    tickers = native_tickers if native else python_tickers
    before = tickers()
    host = WasmHost()
    assert tickers() == before + 1
    host.close()
    assert tickers() == before
    dropped = WasmHost()
    assert tickers() == before + 1
    del dropped
    gc.collect()
    deadline = time.monotonic() + 5
    while tickers() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tickers() == before
    manual = WasmHost(HostConfig(epoch_tick_ms=0))
    assert tickers() == before  # no ticker without a tick period
    manual.close()
