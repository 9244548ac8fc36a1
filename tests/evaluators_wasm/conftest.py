"""Fixtures for the evaluator tests: the standard evaluators run on evald's wasm host
(`evald.host._host`), so these tests exercise the same path the daemon uses.

- ``guest`` / ``run_guest(name, data)`` (``name``: a standard evaluator or a port,
  ``evaluators_wasm.PORTS``) returns ``(value, code, message)`` (``value`` is None on
  error) under generous limits, so the guest's own bounds are what the tests see.
- ``default_limits_guest(name, data)`` returns the host's ``EvalOutcome`` under the daemon's
  default fuel, memory, stack and input/output caps, on a host configured as the daemon's
  (epoch ticker on), with a 5 s deadline: the bomb tests prove every bomb ends within the default
  fuel, and a loaded machine cannot make them flaky (the deadline limit is tested in tests/evald).

The shared checks that use these fixtures are in ``support.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from functools import cache

import pytest

from evald.contract import STANDARD_EVALUATORS
from evald.host import EvalOutcome, HostConfig, Limits, LoadedModule, WasmHost
from evaluators_wasm import port_path, wasm_path
from tests.evaluators_wasm.support import DEFAULT_LIMITS, Outcome, release_compiled

FUEL = 2_000_000_000
#: Generous limits so the guest's own bounds are what the tests see; no wall-clock deadline
#: (the host runs without its epoch ticker), so a loaded machine cannot make a test flaky.
LIMITS = Limits(fuel=FUEL)
#: The default limits but the deadline: wall time is not what the bomb tests check.
BOMB_LIMITS = dataclasses.replace(DEFAULT_LIMITS, deadline_ms=5_000)


_hosts: dict[bool, WasmHost] = {}


def _host(daemon_config: bool) -> WasmHost:
    if daemon_config not in _hosts:
        _hosts[daemon_config] = WasmHost(
            HostConfig() if daemon_config else HostConfig(epoch_tick_ms=0))
    return _hosts[daemon_config]


@cache
def _module(name: str, daemon_config: bool) -> LoadedModule:
    limits = BOMB_LIMITS if daemon_config else LIMITS
    path = wasm_path(name) if name in STANDARD_EVALUATORS else port_path(name)
    return _host(daemon_config).load(path.read_bytes(), limits=limits)


def run_guest(name: str, data: bytes) -> Outcome:
    """Evaluates through evald's wasm host, as the daemon does (reused instance, all checks).

    ``code`` is the ``ErrorCode`` value: a guest code, or a host code such as ``guest_fault``
    (any trap), ``fuel_exhausted``, ``memory_limit``, ``stack_overflow`` or ``input_too_large``.
    """
    outcome = _host(False).evaluate(_module(name, False), data, LIMITS)
    return outcome.value, outcome.error.value if outcome.error else None, outcome.message


def run_with_default_limits(name: str, data: bytes) -> EvalOutcome:
    """Evaluates under :data:`BOMB_LIMITS` on a host configured as the daemon's."""
    return _host(True).evaluate(_module(name, True), data, BOMB_LIMITS)


@pytest.fixture(scope="session", autouse=True)
def _release_host() -> Iterator[None]:
    """Frees the hosts and compiled grammars while wasmtime and XGrammar are still loaded (not
    in interpreter teardown, where their finalizers find their libraries already gone)."""
    yield
    _module.cache_clear()
    for host in _hosts.values():
        host.close()
    _hosts.clear()
    release_compiled()


@pytest.fixture
def guest() -> Callable[[str, bytes], Outcome]:
    return run_guest


@pytest.fixture
def named_guest() -> Callable[[str, bytes], Outcome]:
    """``run_guest`` under a name no test file overrides (``guest`` may be, per implementation)."""
    return run_guest


@pytest.fixture
def default_limits_guest() -> Callable[[str, bytes], EvalOutcome]:
    return run_with_default_limits
