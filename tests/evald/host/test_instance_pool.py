"""Reuse mode's kept instances give their memory back: a forgotten module leaves every thread,
and what one pool key's instances hold, all threads together, stays within its budget."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from evald.host import HostConfig, Limits, LoadedModule, WasmHost
from evald.testing import PAGE, arg, guest, manifest_bytes

MIB = 2**20
PAGES_PER_CALL = 64  # 4 MiB of guest memory written by each call of a "fill" module


@pytest.fixture
def host() -> Iterator[WasmHost]:
    with WasmHost(HostConfig(isolation="reuse")) as wasm_host:
        yield wasm_host


def _filler(host: WasmHost, name: str) -> LoadedModule:
    manifest = manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1")
    return host.load(guest("fill", manifest=manifest), limits=Limits())


def _call_in_a_new_thread(
    host: WasmHost, module: LoadedModule, data: bytes, limits: Limits
) -> None:
    """One call from a thread that ends right after it."""
    outcomes: list[str | None] = []
    thread = threading.Thread(
        target=lambda: outcomes.append(host.evaluate(module, data, limits, pool_key="t").value)
    )
    thread.start()
    thread.join()
    assert outcomes == ["ok"]


def test_forget_drops_every_threads_instances(host: WasmHost) -> None:
    module = _filler(host, "filler")
    limits = Limits()
    barrier = threading.Barrier(3)
    done = threading.Event()

    def worker() -> None:  # a thread that stays alive and idle after its call
        assert host.evaluate(module, arg(PAGES_PER_CALL), limits, pool_key="t").value == "ok"
        barrier.wait()
        done.wait(30)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    barrier.wait()
    try:
        held = host.cached_bytes("t")
        assert held >= 2 * PAGES_PER_CALL * PAGE  # two idle threads keep one instance each
        host.forget(module)  # from a third thread, as the daemon's control thread does
        assert host.cached_bytes("t") == 0
        pool = host._pool
        assert all(not instances for instances in pool._threads)
    finally:
        done.set()
        for thread in threads:
            thread.join()


def test_a_pool_keys_instances_stay_within_its_budget(host: WasmHost) -> None:
    modules = [_filler(host, f"filler{i}") for i in range(6)]
    budget = 3 * PAGES_PER_CALL * PAGE  # room for about two grown instances and a bit
    limits = Limits(instance_cache_bytes=budget)
    with ThreadPoolExecutor(3) as workers:  # threads that live on, as the daemon's workers do
        for module in modules:
            calls = [
                workers.submit(host.evaluate, module, arg(PAGES_PER_CALL), limits, pool_key="t")
                for _ in range(6)
            ]
            assert [call.result().value for call in calls] == ["ok"] * 6
            assert host.cached_bytes("t") <= budget
        kept = sum(len(instances) for instances in host._pool._threads)
        assert kept >= 1  # the budget keeps some, not none
    # another key has its own budget, untouched by this one's
    assert host.cached_bytes("other") == 0


def test_an_instance_over_the_budget_alone_serves_its_call_and_is_not_kept(
    host: WasmHost,
) -> None:
    module = _filler(host, "filler")
    limits = Limits(instance_cache_bytes=PAGES_PER_CALL * PAGE // 2)
    assert host.evaluate(module, arg(PAGES_PER_CALL), limits, pool_key="t").value == "ok"
    assert host.cached_bytes("t") == 0
    # a small instance under the budget is kept
    small = host.load(guest("echo"), limits=Limits())
    assert host.evaluate(small, b"x", limits, pool_key="t").value == "x"
    assert 0 < host.cached_bytes("t") <= limits.instance_cache_bytes


def test_a_thread_that_ends_returns_what_its_instances_held(host: WasmHost) -> None:
    module = _filler(host, "filler")
    _call_in_a_new_thread(host, module, arg(PAGES_PER_CALL), Limits())
    assert host.cached_bytes("t") == 0
    assert host._pool._threads == []


def test_a_call_survives_its_instance_being_forgotten_meanwhile(host: WasmHost) -> None:
    """The hit path takes no lock: a module forgotten between two calls, or while one runs,
    costs the next call a new instance and nothing else."""
    module = host.load(guest("echo"), limits=Limits())
    limits = Limits()
    stop = threading.Event()
    errors: list[str] = []

    def caller() -> None:
        while not stop.is_set():
            outcome = host.evaluate(module, b"x", limits, pool_key="t")
            if outcome.value != "x":
                errors.append(f"{outcome.error}: {outcome.message}")

    threads = [threading.Thread(target=caller) for _ in range(2)]
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between almost any two bytecodes
    for thread in threads:
        thread.start()
    try:
        for _ in range(3000):
            host._pool.forget(module.sha256)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(switch_interval)
    assert errors == []
