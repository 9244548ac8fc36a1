"""Every limit as an n / n+1 pair through the daemon, each followed by a normal call.

The session daemon's ``limits`` tenant has fuel 2,000,000, memory 1 MiB, deadline 50 ms,
input 1000 bytes and output 500 bytes; ``nofuel`` has fuel metering off; the host's module cap
is 256 KiB and its wasm stack the default 256 KiB.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from daemon_harness import Daemon, assert_still_serving, module, outcome, padded

from evald.client import CallError, Client
from evald.testing import arg


def largest_passing(probe: Callable[[int], str], low: int, high: int) -> int:
    """The largest n in [low, high) with probe(n) == "ok", given probe(low) passes and
    probe(high) fails (binary search through the daemon)."""
    assert probe(low) == "ok"
    while high - low > 1:
        middle = (low + high) // 2
        if probe(middle) == "ok":
            low = middle
        else:
            high = middle
    return low


@pytest.fixture(scope="module")
def limits_client(daemon: Daemon) -> Client:
    return daemon.client("limits")


def test_fuel(daemon: Daemon, limits_client: Client) -> None:
    limits_client.register(module("burn", "fuel_burn"))

    def probe(n: int) -> str:
        return outcome(limits_client.evaluate("fuel_burn", arg(n)))

    n = largest_passing(probe, 0, 2_000_000)
    passing = limits_client.evaluate("fuel_burn", arg(n))
    assert outcome(passing) == "ok" and passing.value == "ok"
    assert 0 < passing.fuel_used <= 2_000_000
    failing = limits_client.evaluate("fuel_burn", arg(n + 1))
    assert outcome(failing) == "fuel_exhausted"
    assert "2000000" in failing.error.message
    assert_still_serving(daemon)


def test_memory(daemon: Daemon, limits_client: Client) -> None:
    # One page at start; the cap of 1 MiB is 16 pages: growing by 15 fits, by 16 does not.
    limits_client.register(module("grow", "memory_grow"))
    failing = limits_client.evaluate("memory_grow", arg(16))
    assert outcome(failing) == "memory_limit", failing.error.message
    assert "1048576" in failing.error.message
    passing = limits_client.evaluate("memory_grow", arg(15))
    assert outcome(passing) == "ok"
    assert_still_serving(daemon)


def test_deadline_stops_an_infinite_loop_with_fuel_metering_off(daemon: Daemon) -> None:
    nofuel = daemon.client("nofuel")
    nofuel.register(module("loop", "deadline_loop"))
    nofuel.register(module("burn", "deadline_burn"))
    # A short computation passes within the deadline and fails under a 1 ms one. First: after
    # the long calls below the tenant is heavy for a while (docs/daemon.md), and its calls then
    # run lowered, so on a loaded machine a short one would yield its 50 ms to other work.
    quick = nofuel.evaluate("deadline_burn", arg(2_000_000))
    assert outcome(quick) == "ok"
    assert quick.eval_time_us < 50_000
    cut = nofuel.evaluate("deadline_burn", arg(200_000_000), deadline_ms=1)
    assert outcome(cut) == "deadline_exceeded"
    assert cut.eval_time_us < 40_000
    # A request may ask for more than the tenant's 50 ms; it gets 50 ms.
    looping = nofuel.evaluate("deadline_loop", b"", deadline_ms=60_000)
    assert outcome(looping) == "deadline_exceeded"
    assert 40_000 <= looping.eval_time_us < 5_000_000
    assert_still_serving(daemon)


def test_stack(daemon: Daemon) -> None:
    local = daemon.client()
    local.register(module("recurse", "stack_recurse"))

    def probe(n: int) -> str:
        return outcome(local.evaluate("stack_recurse", arg(n)))

    assert probe(1_000_000) == "stack_overflow"
    n = largest_passing(probe, 1, 1_000_000)
    for _ in range(3):  # the boundary is the same on every worker thread and every time
        assert probe(n) == "ok"
        assert probe(n + 1) == "stack_overflow"
    assert_still_serving(daemon)


def test_input_size(daemon: Daemon, limits_client: Client) -> None:
    limits_client.register(module("return", "input_sink", 0))
    passing = limits_client.evaluate("input_sink", b"x" * 1000)
    assert (outcome(passing), passing.value) == ("ok", "")
    failing = limits_client.evaluate("input_sink", b"x" * 1001)
    assert outcome(failing) == "input_too_large"
    assert failing.fuel_used == 0  # refused before the guest ran
    assert_still_serving(daemon)


def test_output_size(daemon: Daemon, limits_client: Client) -> None:
    limits_client.register(module("output", "output_n"))
    passing = limits_client.evaluate("output_n", arg(500))
    assert (outcome(passing), passing.value) == ("ok", "x" * 500)
    failing = limits_client.evaluate("output_n", arg(501))
    assert outcome(failing) == "output_too_large"
    assert "501" in failing.error.message
    assert_still_serving(daemon)


def test_module_size(daemon: Daemon) -> None:
    local = daemon.client()
    cap = 256 * 1024
    base = module("echo", "sized")
    local.register(padded(base, cap))
    assert outcome(local.evaluate("sized", b"fits")) == "ok"
    with pytest.raises(CallError) as refused:
        local.register(padded(module("echo", "oversized"), cap + 1))
    assert refused.value.code is not None and refused.value.code.value == "invalid_module"
    assert str(cap) in refused.value.message
    assert "oversized" not in {info.name for info in local.list_evaluators()}
    assert_still_serving(daemon)
