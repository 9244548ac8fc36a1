"""Fixtures for the evaluator tests.

``run_guest(name, data)`` runs a built standard evaluator on ``data`` and returns
``(value, code, message)`` — ``value`` is None on error. It runs on evald's wasm host
(`evald._host`), so these tests exercise the same path the daemon uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache

import pytest

from evald._host import HostConfig, Limits, LoadedModule, WasmHost
from evaluators_wasm import wasm_path

Outcome = tuple[str | None, str | None, str]

FUEL = 2_000_000_000
#: Generous limits so the guest's own bounds are what the tests see; no wall-clock deadline
#: (the host runs without its epoch ticker), so a loaded machine cannot make a test flaky.
LIMITS = Limits(fuel=FUEL)


@cache
def _host() -> WasmHost:
    return WasmHost(HostConfig(epoch_tick_ms=0))


@cache
def _module(name: str) -> LoadedModule:
    return _host().load(wasm_path(name).read_bytes(), limits=LIMITS)


def run_guest(name: str, data: bytes) -> Outcome:
    """Evaluates through evald's wasm host, as the daemon does (reused instance, all checks).

    ``code`` is the ``ErrorCode`` value: a guest code, or a host code such as ``guest_fault``
    (any trap), ``fuel_exhausted``, ``memory_limit``, ``stack_overflow`` or ``input_too_large``.
    """
    outcome = _host().evaluate(_module(name), data, LIMITS)
    return outcome.value, outcome.error.value if outcome.error else None, outcome.message


@pytest.fixture(scope="session", autouse=True)
def _release_host() -> Iterator[None]:
    """Frees the shared host while wasmtime is still loaded (not in interpreter teardown)."""
    yield
    if _host.cache_info().currsize:
        _host().close()
    _module.cache_clear()
    _host.cache_clear()


@pytest.fixture
def guest() -> Callable[[str, bytes], Outcome]:
    return run_guest
