"""Every limit as an n / n+1 pair, and after each the same host still answers correctly: in every
isolation mode (fresh with the pooling and with the default allocator, and reuse)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from evald.contract import ErrorCode, EvaldError
from evald.host import EvalOutcome, HostConfig, Limits, LoadedModule, WasmHost, _engine
from evald.testing import PAGE, arg, guest

UNMETERED = Limits(fuel=0, deadline_ms=10_000)


MODES = {
    "fresh-pooling": HostConfig(isolation="fresh", allocator="pooling"),
    "fresh-default": HostConfig(isolation="fresh", allocator="default"),
    "reuse": HostConfig(isolation="reuse"),
}


@pytest.fixture(scope="module", params=list(MODES))
def host(request: pytest.FixtureRequest) -> Iterator[WasmHost]:
    with WasmHost(MODES[request.param]) as wasm_host:
        yield wasm_host


@pytest.fixture(scope="module")
def echo(host: WasmHost) -> LoadedModule:
    return host.load(guest("echo"))


def still_serves(
    host: WasmHost,
    echo: LoadedModule,
    module: LoadedModule | None = None,
    data: bytes = b"",
    expected: str = "",
) -> None:
    """The host answers a normal call, and so does the module that just hit a limit."""
    outcome = host.evaluate(echo, b"still serving", Limits())
    assert (outcome.value, outcome.error) == ("still serving", None)
    if module is not None:
        outcome = host.evaluate(module, data, Limits())
        assert (outcome.value, outcome.error) == (expected, None), outcome


def smallest_passing(check: Callable[[int], bool], high: int) -> int:
    """The least n in [0, high] with check(n), for a check that is monotone in n."""
    assert check(high)
    low = 0
    while low < high:
        middle = (low + high) // 2
        if check(middle):
            high = middle
        else:
            low = middle + 1
    return low


def test_fuel(host: WasmHost, echo: LoadedModule) -> None:
    burn = host.load(guest("burn"))
    data = arg(5000)
    needed = host.evaluate(burn, data, UNMETERED).fuel_used
    assert needed > 5000  # about two units per loop iteration

    def passes(fuel: int) -> bool:
        outcome = host.evaluate(burn, data, Limits(fuel=max(fuel, 1)))
        assert outcome.error in (None, ErrorCode.FUEL_EXHAUSTED), outcome
        return outcome.error is None

    # wasmtime checks fuel at loop heads and calls, so the boundary is found, not assumed
    n = smallest_passing(passes, needed)
    assert n > 5000
    ok = host.evaluate(burn, data, Limits(fuel=n))
    assert (ok.value, ok.error) == ("ok", None)
    out = host.evaluate(burn, data, Limits(fuel=n - 1))
    assert out.error is ErrorCode.FUEL_EXHAUSTED
    assert f"all {n - 1} units of fuel" in out.message
    assert out.fuel_used >= n - 1
    still_serves(host, echo, burn, arg(10), "ok")


def test_memory(host: WasmHost, echo: LoadedModule) -> None:
    grow = host.load(guest("grow"))
    assert grow.grow_observed
    pages = 5  # the module starts with one page
    cap = (1 + pages) * PAGE
    ok = host.evaluate(grow, arg(pages), Limits(memory_bytes=cap), pool_key="memory")
    assert (ok.value, ok.error) == ("ok", None)
    out = host.evaluate(grow, arg(pages), Limits(memory_bytes=cap - 1), pool_key="memory")
    assert out.error is ErrorCode.MEMORY_LIMIT
    assert f"memory limit of {cap - 1} bytes" in out.message
    still_serves(host, echo, grow, arg(0), "ok")


def test_the_pool_slot_bounds_a_larger_tenant_cap() -> None:
    # With the pooling allocator a store never gets more memory than its slot, whatever the
    # tenant's limit says; the cap the call runs under, and reports, is the slot.
    slot = 4 * PAGE
    with WasmHost(HostConfig(isolation="fresh", pool_memory_bytes=slot)) as pooled:
        grow = pooled.load(guest("grow"))
        limits = Limits(memory_bytes=64 * PAGE)
        assert pooled.memory_cap(limits) == slot
        assert pooled.evaluate(grow, arg(3), limits).value == "ok"  # 1 + 3 pages: the slot
        out = pooled.evaluate(grow, arg(4), limits)
        assert out.error is ErrorCode.MEMORY_LIMIT
        assert f"memory limit of {slot} bytes" in out.message
        assert pooled.evaluate(grow, arg(0), limits).value == "ok"


def test_memory_grown_one_page_at_a_time(host: WasmHost, echo: LoadedModule) -> None:
    grow = host.load(guest("grow_pages"))
    ok = host.evaluate(grow, arg(3), Limits(memory_bytes=4 * PAGE), pool_key="pages-ok")
    assert (ok.value, ok.error) == ("ok", None)
    out = host.evaluate(grow, arg(4), Limits(memory_bytes=4 * PAGE), pool_key="pages-out")
    assert out.error is ErrorCode.MEMORY_LIMIT
    still_serves(host, echo)


def test_a_refused_grow_the_guest_handles_is_its_own_error(host: WasmHost) -> None:
    soft = host.load(guest("grow_soft"))
    out = host.evaluate(soft, arg(100), Limits(memory_bytes=50 * PAGE))
    assert (out.error, out.message) == (ErrorCode.TOO_LARGE, "out of memory")
    ok = host.evaluate(soft, arg(1), Limits(memory_bytes=50 * PAGE))
    assert ok.value == "ok"


def test_memory_minimum_above_a_tenant_cap(host: WasmHost, echo: LoadedModule) -> None:
    big = host.load(guest("echo", pages=8), limits=Limits(memory_bytes=8 * PAGE))
    ok = host.evaluate(big, b"x", Limits(memory_bytes=8 * PAGE))
    assert ok.value == "x"
    out = host.evaluate(big, b"x", Limits(memory_bytes=8 * PAGE - 1), pool_key="small")
    assert out.error is ErrorCode.MEMORY_LIMIT and "needs 524288 bytes" in out.message
    with pytest.raises(EvaldError, match="declared minimum is 8 pages"):
        host.load(guest("echo", pages=8), limits=Limits(memory_bytes=8 * PAGE - 1))
    still_serves(host, echo)


def test_deadline_in_epoch_ticks() -> None:
    # With the ticker off the test drives the epoch: a deadline of 3 ms is 3 ticks. After 2
    # the guest (an infinite loop, fuel not metered) still runs; the 3rd stops it.
    with WasmHost(HostConfig(epoch_tick_ms=0)) as host:
        loop = host.load(guest("loop"))
        echo = host.load(guest("echo"))
        result: list[EvalOutcome] = []
        thread = threading.Thread(
            target=lambda: result.append(host.evaluate(loop, b"", Limits(fuel=0, deadline_ms=3)))
        )
        thread.start()
        time.sleep(0.05)
        host.advance_epoch(2)
        time.sleep(0.1)
        assert thread.is_alive() and not result
        host.advance_epoch(1)
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert result[0].error is ErrorCode.DEADLINE_EXCEEDED
        assert "deadline of 3 ms" in result[0].message
        still_serves(host, echo)


def test_deadline_with_the_ticker_stops_an_infinite_loop(
    host: WasmHost, echo: LoadedModule
) -> None:
    loop = host.load(guest("loop"))
    out = host.evaluate(loop, b"", Limits(fuel=0, deadline_ms=50))
    assert out.error is ErrorCode.DEADLINE_EXCEEDED
    assert out.elapsed_us >= 45_000  # the epoch never runs ahead of the wall clock
    burn = host.load(guest("burn"))
    ok = host.evaluate(burn, arg(1000), Limits(fuel=0, deadline_ms=5_000))
    assert ok.value == "ok"
    still_serves(host, echo)


def test_wasm_stack(host: WasmHost, echo: LoadedModule) -> None:
    recurse = host.load(guest("recurse"))

    def overflows(depth: int) -> bool:
        outcome = host.evaluate(recurse, arg(depth), UNMETERED)
        assert outcome.error in (None, ErrorCode.STACK_OVERFLOW), outcome
        return outcome.error is ErrorCode.STACK_OVERFLOW

    first_overflow = smallest_passing(overflows, 1_000_000)
    deepest = first_overflow - 1
    assert deepest > 1000  # 256 KiB of stack holds thousands of small frames
    ok = host.evaluate(recurse, arg(deepest), UNMETERED)
    assert (ok.value, ok.error) == ("ok", None)
    out = host.evaluate(recurse, arg(deepest + 1), UNMETERED)
    assert out.error is ErrorCode.STACK_OVERFLOW
    assert "262144 bytes" in out.message
    still_serves(host, echo, recurse, arg(10), "ok")


def test_a_smaller_stack_cap_overflows_sooner(host: WasmHost) -> None:
    with WasmHost(HostConfig(max_wasm_stack_bytes=64 * 1024)) as small:
        recurse = small.load(guest("recurse"))
        depth = 3000
        assert host.evaluate(host.load(guest("recurse")), arg(depth), UNMETERED).value == "ok"
        assert small.evaluate(recurse, arg(depth), UNMETERED).error is ErrorCode.STACK_OVERFLOW


def test_input_size(host: WasmHost, echo: LoadedModule) -> None:
    limit = 100
    ok = host.evaluate(echo, b"a" * limit, Limits(input_bytes=limit))
    assert ok.value == "a" * limit
    out = host.evaluate(echo, b"a" * (limit + 1), Limits(input_bytes=limit))
    assert out.error is ErrorCode.INPUT_TOO_LARGE
    assert out.fuel_used == 0  # the guest was not called
    assert "the limit is 100 bytes" in out.message
    still_serves(host, echo)


def test_input_size_against_the_guest_buffer(host: WasmHost, echo: LoadedModule) -> None:
    small = host.load(guest("echo", in_cap=64))
    assert small.input_cap == 64
    assert host.evaluate(small, b"b" * 64, Limits()).value == "b" * 64
    out = host.evaluate(small, b"b" * 65, Limits())
    assert out.error is ErrorCode.INPUT_TOO_LARGE
    assert "accepts at most 64 bytes" in out.message
    still_serves(host, echo, small, b"fine", "fine")


def test_output_size(host: WasmHost, echo: LoadedModule) -> None:
    output = host.load(guest("output"))
    size = 300
    ok = host.evaluate(output, arg(size), Limits(output_bytes=size))
    assert ok.value == "x" * size
    out = host.evaluate(output, arg(size), Limits(output_bytes=size - 1))
    assert out.error is ErrorCode.OUTPUT_TOO_LARGE
    assert f"value of {size} bytes" in out.message
    still_serves(host, echo, output, arg(3), "xxx")


def test_error_payloads_count_against_the_output_limit(host: WasmHost) -> None:
    payload = b"syntax:" + b"m" * 93
    module = host.load(guest("payload", (payload, True)))
    assert host.evaluate(module, b"", Limits(output_bytes=100)).error is ErrorCode.SYNTAX
    out = host.evaluate(module, b"", Limits(output_bytes=99))
    assert out.error is ErrorCode.OUTPUT_TOO_LARGE and "error payload" in out.message


def test_module_size(echo: LoadedModule) -> None:
    wasm = guest("echo", extra="(func $padding (drop (i32.const 1)))")
    with WasmHost(HostConfig(module_bytes=len(wasm))) as exact:
        assert exact.load(wasm).size_bytes == len(wasm)
    with WasmHost(HostConfig(module_bytes=len(wasm) - 1)) as smaller:
        with pytest.raises(EvaldError) as caught:
            smaller.load(wasm)
        assert caught.value.code is ErrorCode.INVALID_MODULE
        assert f"the module is {len(wasm)} bytes" in caught.value.message
        module = smaller.load(guest("echo"))  # a smaller module still loads and runs
        assert smaller.evaluate(module, b"after", Limits()).value == "after"


@pytest.mark.parametrize(
    "changes",
    [{"fuel": -1}, {"fuel": 2**63}, {"deadline_ms": 0}, {"memory_bytes": 1.5}, {"input_bytes": -3}],
)
def test_limits_refuse_nonsense(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="Limits"):
        Limits(**changes)  # type: ignore[arg-type]


def test_a_lagging_ticker_never_cuts_a_call_short(
    echo: LoadedModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A starved ticker thread catches up in a burst of increments. Starvation cannot be
    # produced on demand, so it is simulated (named fake): the ticker's clock origin is moved
    # one second back, so it owes ~1000 ticks and pays them at its next wake-up, while a call
    # with a 200 ms deadline is running. The call must still get its 200 ms. (The Python
    # fallback ticker: the native one's clock origin lives in C.)
    monkeypatch.setattr(_engine, "_NATIVE", None)
    with WasmHost() as host:
        burn = host.load(guest("burn"))
        ticker = host._ticker
        assert ticker is not None
        ticker._start -= 1.0  # the simulated starvation
        assert ticker.lag_ticks() >= 900
        outcome = host.evaluate(burn, arg(5_000_000), Limits(fuel=0, deadline_ms=200))
        assert (outcome.value, outcome.error) == ("ok", None)
        # The burst happened (during the call, unless a loaded machine kept the ticker thread
        # from running until after it: the call's outcome holds either way).
        give_up = time.monotonic() + 30
        while ticker.lag_ticks() >= 900 and time.monotonic() < give_up:
            time.sleep(0.01)
        assert ticker.lag_ticks() < 900
        still_serves(host, host.load(guest("echo")))
