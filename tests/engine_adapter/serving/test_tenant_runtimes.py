"""The engine-neutral tenant layer (``TenantRuntimes``) against a real daemon: who gets the
server's own tenant, who takes a slot, what a flood of made-up tokens costs, eviction, and the
spec refresh on a new daemon revision. Every wait below reads a counter or a future the code
sets, never a clock."""

from __future__ import annotations

import concurrent.futures
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from daemon_harness import TOKENS, Daemon, module

from engine_adapter import TokenCodec
from engine_adapter.serving._server_config import AdapterConfig
from engine_adapter.serving._tenant_runtimes import TenantRuntimes
from evald.contract import ErrorCode

CODEC = TokenCodec([b"a", b"b"])


def _until(condition: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Polls what the code decided (a counter, a table size); the limit only ends a hang."""
    give_up = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < give_up, f"never happened: {what}"
        time.sleep(0.01)


def _value(runtime: Any, content: str = "6 * 7") -> tuple[str | None, str | None]:
    result = runtime.submit("calc", content, 5000)
    runtime.flush()
    answer = result.result(timeout=30)
    return answer.value, answer.error_code


@pytest.fixture
def tenants(daemon: Daemon) -> Iterator[Callable[..., TenantRuntimes]]:
    made: list[TenantRuntimes] = []

    def make(token: str | None = None, **options: Any) -> TenantRuntimes:
        runtimes = TenantRuntimes(AdapterConfig(daemon.target, token), CODEC, **options)
        made.append(runtimes)
        return runtimes

    yield make
    for runtimes in made:
        runtimes.close()


@pytest.mark.parametrize("token", ["", " ", "\t\n", " alpha-token-0123456789", "a\x00b", 7])
def test_a_named_token_that_cannot_be_one_is_denied_not_the_tokenless_tenant(
    tenants: Callable[..., TenantRuntimes], token: Any
) -> None:
    """The server here runs as the unix socket's token-less tenant (which may call calc): a
    request naming an empty, blank or malformed token must not be served as that tenant."""
    runtimes = tenants()
    assert _value(runtimes.for_request({}).runtime) == ("42", None)
    tenancy = runtimes.for_request({"evald_token": token})
    assert tenancy.runtime is not runtimes.default
    assert _value(tenancy.runtime) == (None, ErrorCode.PERMISSION_DENIED)
    assert len(runtimes) == 0 and runtimes.stats["accepted"] == 0


def test_ten_thousand_bad_tokens_then_a_real_tenant_is_served(
    tenants: Callable[..., TenantRuntimes],
) -> None:
    runtimes = tenants(max_checking=32, refused_kept=500)
    flood = [
        runtimes.for_request({"evald_token": f"made-up-{i:05d}"}).runtime for i in range(10_000)
    ]
    answered = [runtime.submit("calc", "1 + 1", 30_000) for runtime in flood[-200:]]
    real = runtimes.for_request({"evald_token": TOKENS["alpha"]}).runtime
    assert _value(real) == ("42", None)
    assert len(runtimes) == 1  # the real tenant holds the only slot
    for future in answered:
        assert future.result(timeout=60).error_code in (
            ErrorCode.PERMISSION_DENIED,
            ErrorCode.UNAUTHENTICATED,
            ErrorCode.UNAVAILABLE,
        )
    sizes = runtimes.sizes()
    assert sizes["refused"] <= 500 and sizes["waiting"] <= 32
    _until(lambda: all(runtime.admitted for runtime in flood), "every flood token answered")
    assert all(runtime.refusal is not None for runtime in flood)  # the flood paid for itself
    assert runtimes.stats["dropped"] + runtimes.stats["refused"] == 10_000


def test_a_refused_token_is_remembered_without_a_slot(
    tenants: Callable[..., TenantRuntimes],
) -> None:
    runtimes = tenants(refused_kept=3)
    for i in range(10):
        runtime = runtimes.for_request({"evald_token": f"wrong-{i}"}).runtime
        assert _value(runtime)[1] in (ErrorCode.PERMISSION_DENIED, ErrorCode.UNAUTHENTICATED)
    assert runtimes.sizes()["refused"] == 3 and len(runtimes) == 0
    checked = runtimes.stats["refused"]
    again = runtimes.for_request({"evald_token": "wrong-9"}).runtime
    assert again.refusal is not None and runtimes.stats["refused"] == checked  # not re-asked
    assert runtimes.stats["refused_cached"] == 1


def test_the_least_recently_used_and_idle_tenants_are_evicted(
    tenants: Callable[..., TenantRuntimes],
) -> None:
    runtimes = tenants(max_tenants=2, refresh_s=None)
    for name in ("alpha", "beta", "viewer"):
        runtime = runtimes.for_request({"evald_token": TOKENS[name]}).runtime
        assert _value(runtime) == ("42", None)
    assert len(runtimes) == 2 and runtimes.stats["evicted"] == 1
    alpha = runtimes.for_request({"evald_token": TOKENS["alpha"]}).runtime
    assert _value(alpha) == ("42", None)
    assert runtimes.stats["accepted"] == 4  # evicted first: checked again before a slot
    runtimes.idle_s = 3600.0
    for runtime in runtimes.runtimes()[1:]:
        runtime.last_used -= 7200.0  # idle for two hours, as far as the table can tell
    runtimes.for_request({"evald_token": TOKENS["beta"]})
    assert runtimes.stats["evicted"] == 4  # alpha pushed beta out; then both idle ones


def test_a_request_to_another_address_gets_no_server_token(daemon: Daemon) -> None:
    asked: list[AdapterConfig] = []

    def check(config: AdapterConfig) -> tuple[list[Any], int]:
        asked.append(config)
        return [], 1

    other = "unix:/run/evald/other.sock"
    runtimes = TenantRuntimes(
        AdapterConfig(daemon.target, TOKENS["alpha"]),
        CODEC,
        allowed=frozenset({daemon.target, other}),
        check=check,
    )
    try:
        runtime = runtimes.for_request({"evald_target": other}).runtime
        runtime.admitted or _until(lambda: runtime.admitted, "the check")
        assert [(c.target, c.token) for c in asked] == [(other, None)]
        assert runtimes.for_request({"evald_target": daemon.target}).runtime is runtimes.default
    finally:
        runtimes.close()


def test_a_new_daemon_revision_refreshes_the_specs(
    daemon: Daemon, tenants: Callable[..., TenantRuntimes]
) -> None:
    runtimes = tenants(refresh_s=0.05)
    tenant = runtimes.for_request({"evald_token": TOKENS["beta"]}).runtime
    before = {spec.name for spec in tenant.evaluators()}
    revision = tenant.revision
    assert "refresh_probe" not in before
    daemon.client("beta").register(module("echo", "refresh_probe"), replace=True)
    _until(lambda: tenant.revision > revision, "the refresh")
    assert "refresh_probe" in {spec.name for spec in tenant.evaluators()}


def test_a_span_submitted_before_admission_waits_for_it_without_blocking(
    daemon: Daemon,
) -> None:
    gate = concurrent.futures.Future[None]()

    def check(config: AdapterConfig) -> tuple[list[Any], int]:
        gate.result(timeout=60)
        from engine_adapter.evaluation._client import evaluator_listing

        return evaluator_listing(config.target, config.token)

    runtimes = TenantRuntimes(AdapterConfig(daemon.target), CODEC, check=check, refresh_s=None)
    try:
        runtime = runtimes.for_request({"evald_token": TOKENS["alpha"]}).runtime
        future = runtime.submit("calc", "2 * 21", 30_000)  # returns at once
        assert not future.done() and not runtime.admitted and len(runtimes) == 0
        gate.set_result(None)
        assert future.result(timeout=30).value == "42" and len(runtimes) == 1
    finally:
        runtimes.close()


def test_no_secret_in_a_repr() -> None:
    from engine_adapter.serving._request_options import request_options
    from evald.contract import Endpoint

    config = AdapterConfig("unix:/x", "s3cret-token-value")
    assert "s3cret" not in repr(config)
    assert "s3cret" not in repr(Endpoint.resolve("unix:/x", "s3cret-token-value"))
    reading = request_options({"evald_token": "s3cret-other"}, (), config, frozenset({"unix:/x"}))
    assert "s3cret" not in repr(reading)
    gc.collect()
