"""Instance reuse and isolation: pool keys, discarding after traps, buffer zeroing, threads."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from evald.contract import ErrorCode
from evald.host import EvalOutcome, HostConfig, Limits, WasmHost
from evald.testing import PAGE, arg, guest


@pytest.fixture(scope="module")
def host() -> Iterator[WasmHost]:
    with WasmHost() as wasm_host:
        yield wasm_host


def values(outcomes: list[EvalOutcome]) -> list[str | None]:
    return [outcome.value for outcome in outcomes]


def test_reuse_keeps_one_instance_per_pool_key(host: WasmHost) -> None:
    count = host.load(guest("count"))
    limits = Limits()
    first = [host.evaluate(count, b"x", limits, pool_key="tenant-a") for _ in range(3)]
    assert values(first) == ["1", "2", "3"]
    other = host.evaluate(count, b"x", limits, pool_key="tenant-b")
    assert other.value == "1"  # another tenant never shares the instance
    assert host.evaluate(count, b"x", limits, pool_key="tenant-a").value == "4"


def test_an_instance_is_discarded_after_a_trap(host: WasmHost) -> None:
    count = host.load(guest("count"))
    assert values([host.evaluate(count, b"x", Limits(), pool_key="t") for _ in range(2)]) == [
        "1",
        "2",
    ]
    trapped = host.evaluate(count, b"", Limits(), pool_key="t")  # empty input traps
    assert trapped.error is ErrorCode.GUEST_FAULT
    assert host.evaluate(count, b"x", Limits(), pool_key="t").value == "1"  # a new instance


def test_an_instance_is_discarded_after_a_malformed_output(host: WasmHost) -> None:
    # "count" never returns a bad length, so use a module whose bad output follows state
    module = host.load(guest("return", -(2**31)))
    assert host.evaluate(module, b"", Limits(), pool_key="bad").error is ErrorCode.GUEST_FAULT
    assert host.evaluate(module, b"", Limits(), pool_key="bad").error is ErrorCode.GUEST_FAULT


def test_fresh_mode_instantiates_per_call() -> None:
    for allocator in ("pooling", "default"):
        with WasmHost(HostConfig(isolation="fresh", allocator=allocator)) as host:
            count = host.load(guest("count"))
            outcomes = [host.evaluate(count, b"x", Limits()) for _ in range(3)]
            assert values(outcomes) == ["1", "1", "1"], allocator


def test_reuse_zeroes_the_input_buffer(host: WasmHost) -> None:
    dump = host.load(guest("dump_input", 16))
    first = host.evaluate(dump, b"secret-data", Limits(), pool_key="z")
    assert first.value == "secret-data" + "\0" * 5
    second = host.evaluate(dump, b"", Limits(), pool_key="z")
    assert second.value == "\0" * 16  # the first call's input is gone


def test_reuse_zeroes_the_returned_output(host: WasmHost) -> None:
    stale = host.load(guest("stale_output", 8))
    assert host.evaluate(stale, b"abcdefgh", Limits(), pool_key="o").value == "xxxxxxxx"
    assert host.evaluate(stale, b"", Limits(), pool_key="o").value == "\0" * 8


def test_buffers_are_also_zeroed_after_a_guest_error(host: WasmHost) -> None:
    # a guest error is not a trap: the instance stays, so its buffers must be cleared too
    module = host.load(guest("dump_or_error", 12))
    failed = host.evaluate(module, b"e-secret", Limits(), pool_key="e")
    assert (failed.error, failed.message) == (ErrorCode.SYNTAX, "probe: syntax")
    after = host.evaluate(module, b"d", Limits(), pool_key="e")
    assert after.value == "d" + "\0" * 11  # not "d-secret"


def test_a_lower_memory_cap_for_the_same_key_takes_effect(host: WasmHost) -> None:
    grow = host.load(guest("grow"))
    big = Limits(memory_bytes=20 * PAGE)
    assert host.evaluate(grow, arg(10), big, pool_key="m").value == "ok"  # now 11 pages
    small = Limits(memory_bytes=5 * PAGE)
    # the live instance is larger than the new cap: a new one is made under the new cap
    assert host.evaluate(grow, arg(3), small, pool_key="m").value == "ok"
    assert host.evaluate(grow, arg(3), small, pool_key="m").error is ErrorCode.MEMORY_LIMIT


def test_a_later_trap_is_not_blamed_on_an_earlier_refused_grow(host: WasmHost) -> None:
    module = host.load(guest("grow_or_trap"))
    limits = Limits(memory_bytes=4 * PAGE)
    assert host.evaluate(module, b"g", limits, pool_key="flag").value == "ok"  # grow refused
    trapped = host.evaluate(module, b"t", limits, pool_key="flag")
    assert trapped.error is ErrorCode.GUEST_FAULT


def test_instances_per_thread_are_bounded() -> None:
    with WasmHost(HostConfig(instances_per_thread=2)) as host:
        count = host.load(guest("count"))
        for key in ("a", "b", "c"):
            assert host.evaluate(count, b"x", Limits(), pool_key=key).value == "1"
        assert host.evaluate(count, b"x", Limits(), pool_key="c").value == "2"  # kept
        assert host.evaluate(count, b"x", Limits(), pool_key="a").value == "1"  # evicted


def test_forget_drops_this_threads_instances(host: WasmHost) -> None:
    count = host.load(guest("count"))
    assert host.evaluate(count, b"x", Limits(), pool_key="f").value == "1"
    host.forget(count)
    assert host.evaluate(count, b"x", Limits(), pool_key="f").value == "1"


def test_two_threads_evaluate_at_once(host: WasmHost) -> None:
    echo = host.load(guest("echo"))
    burn = host.load(guest("burn"))
    count = host.load(guest("count"))
    barrier = threading.Barrier(2)

    def work(worker: int) -> list[tuple[str | None, str | None]]:
        barrier.wait()
        seen = []
        for i in range(200):
            text = f"worker {worker} call {i}"
            seen.append((host.evaluate(echo, text.encode(), Limits()).value, text))
            if i % 50 == 0:
                seen.append((host.evaluate(burn, arg(20_000), Limits()).value, "ok"))
        seen.append((host.evaluate(count, b"x", Limits(), pool_key="shared").value, "1"))
        return seen

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(work, range(2)))
    for seen in results:
        assert all(got == expected for got, expected in seen)
    # each thread had its own instance for the same pool key: both counted "1"


def test_two_deadlines_run_out_side_by_side(host: WasmHost) -> None:
    loop = host.load(guest("loop"))
    barrier = threading.Barrier(2)

    def run(_: int) -> EvalOutcome:
        barrier.wait()
        return host.evaluate(loop, b"", Limits(fuel=0, deadline_ms=100))

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(run, range(2)))
    assert [o.error for o in outcomes] == [ErrorCode.DEADLINE_EXCEEDED] * 2


def test_a_reused_instance_takes_a_new_memory_view_after_a_grow(host: WasmHost) -> None:
    # Copies go through a byte view of the guest memory; a call that grows the memory (which
    # may move it) must leave the instance with a view of the whole grown memory.
    grow = host.load(guest("grow"))
    limits = Limits(memory_bytes=40 * PAGE)
    for pages in (1, 3, 5):
        assert host.evaluate(grow, arg(pages), limits, pool_key="view").value == "ok"
        instance = host._pool.instances()["view", grow.sha256]
        assert instance.view_size == instance.memory.size() == len(instance.view)
    assert instance.view_size >= 10 * PAGE
    dump = host.load(guest("dump_input", 16))
    assert host.evaluate(dump, b"after", limits, pool_key="view").value == "after" + "\0" * 11
