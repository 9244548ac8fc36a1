"""The engine-neutral tenant layer (``TenantRuntimes``) against a real daemon: who gets the
server's own tenant, who takes a slot, what a flood of made-up tokens costs, eviction (one
tenant's many tokens evict only its own), an address that hangs, and the spec refresh on a new
daemon revision. Every wait below reads a counter or a future the code sets, never a clock."""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import TOKENS, Daemon, module, start_daemon

from engine_adapter import TokenCodec
from engine_adapter.evaluation import EvaluatorListing, tenant_listing
from engine_adapter.serving._server_config import AdapterConfig
from engine_adapter.serving._tenant_runtimes import TenantRuntimes
from engine_adapter.testing import SilentAddress
from evald.contract import ErrorCode
from evald.daemon import hash_token
from evald.testing import tenant_table

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


def test_one_tenants_many_tokens_evict_only_its_own(tmp_path: Path) -> None:
    """A tenant with more valid tokens than there are slots (the issue's 300 for 256, scaled
    down) takes every slot but one other tenant's: each of its tokens past the cap evicts its
    own least recently used one, and a third tenant's first token takes a slot from it too.
    Before, the least recently used token of any tenant went: the quiet tenant first."""
    crowd = [f"crowd-{i:03d}-token-0123456789" for i in range(30)]
    quiet, third = "quiet-token-0123456789", "third-token-0123456789"
    config = "\n".join(
        [
            "[server]\nthreads = 2\nshutdown_grace_s = 2",
            tenant_table(
                "crowd", token_sha256s=[hash_token(t) for t in crowd], evaluators=["calc"]
            ),
            tenant_table("quiet", token=quiet, evaluators=["*"]),
            tenant_table("third", token=third, evaluators=["calc", "date"]),
        ]
    )
    evald = start_daemon(tmp_path, config)
    runtimes = TenantRuntimes(AdapterConfig(evald.target), CODEC, max_tenants=8, refresh_s=None)
    try:
        held = runtimes.for_request({"evald_token": quiet}).runtime
        assert _value(held) == ("42", None)
        for token in crowd:
            runtime = runtimes.for_request({"evald_token": token}).runtime
            _until(lambda runtime=runtime: runtime.admitted, "the crowd token's check")
            assert runtime.refusal is None
        assert held in runtimes.runtimes()
        assert sorted(runtimes.parties().values()) == [1, 7]
        assert runtimes.stats["evicted"] == 1 + 30 - 8  # every one of them the crowd's
        newcomer = runtimes.for_request({"evald_token": third}).runtime
        assert _value(newcomer) == ("42", None)
        assert sorted(runtimes.parties().values()) == [1, 1, 6]
        assert runtimes.for_request({"evald_token": quiet}).runtime is held  # never re-checked
        assert runtimes.stats["accepted"] == 1 + 30 + 1
    finally:
        runtimes.close()
        evald.stop()


OTHER = "other-token-0123456789"


def _twins_daemon(tmp_path: Path, crowd: list[str], quiet: str) -> Daemon:
    """Two tenants that see exactly the same evaluators (calc from the standard set, no modules
    of their own): ``crowd`` with many tokens, ``quiet`` with one; and ``other``, which sees
    calc and date (token :data:`OTHER`)."""
    config = "\n".join(
        [
            "[server]\nthreads = 2\nshutdown_grace_s = 2",
            tenant_table(
                "crowd", token_sha256s=[hash_token(t) for t in crowd], evaluators=["calc"]
            ),
            tenant_table("quiet", token=quiet, evaluators=["calc"]),
            tenant_table("other", token=OTHER, evaluators=["calc", "date"]),
        ]
    )
    return start_daemon(tmp_path, config)


def test_two_tenants_that_see_the_same_evaluators_are_two_parties(tmp_path: Path) -> None:
    """Tenants are told apart by the tenant evald names for each token (``ListEvaluators``),
    not by what they see: a tenant whose 30 tokens pass the cap of 8 evicts only its own, even
    when the other tenant sees exactly its evaluators. Before, the two were one party (the
    same evaluator digest), and the quiet tenant's token, least recently used, went first."""
    crowd = [f"crowd-{i:03d}-token-0123456789" for i in range(30)]
    quiet = "quiet-token-0123456789"
    evald = _twins_daemon(tmp_path, crowd, quiet)
    runtimes = TenantRuntimes(AdapterConfig(evald.target), CODEC, max_tenants=8, refresh_s=None)
    try:
        assert tenant_listing(evald.target, quiet).tenant == "quiet"
        held = runtimes.for_request({"evald_token": quiet}).runtime
        assert _value(held) == ("42", None)
        for token in crowd:
            runtime = runtimes.for_request({"evald_token": token}).runtime
            _until(lambda runtime=runtime: runtime.admitted, "the crowd token's check")
            assert runtime.refusal is None
        assert held in runtimes.runtimes()
        assert sorted(runtimes.parties().values()) == [1, 7]
        assert runtimes.stats["evicted"] == 1 + 30 - 8  # every one of them the crowd's
        assert runtimes.for_request({"evald_token": quiet}).runtime is held  # never re-checked
        assert runtimes.stats["accepted"] == 1 + 30
    finally:
        runtimes.close()
        evald.stop()


def test_a_daemon_that_names_no_tenant_groups_tokens_by_their_evaluators(
    tmp_path: Path,
) -> None:
    """The fallback for a daemon older than ``ListEvaluatorsResponse.tenant``: its answers are
    played by a check that drops the name (a stand-in for that daemon's reply, which this
    repository cannot build). Tokens are grouped by the evaluators they grant, so the twins
    share one party; a tenant that sees other evaluators is a party of its own."""
    crowd = [f"crowd-{i:03d}-token-0123456789" for i in range(3)]
    quiet = "quiet-token-0123456789"
    evald = _twins_daemon(tmp_path, crowd, quiet)

    def unnamed(config: AdapterConfig) -> EvaluatorListing:
        listing = tenant_listing(config.target, config.token)
        return EvaluatorListing(listing.evaluators, listing.revision, "")

    runtimes = TenantRuntimes(AdapterConfig(evald.target), CODEC, check=unnamed, refresh_s=None)
    try:
        for token in [quiet, *crowd, OTHER]:
            assert _value(runtimes.for_request({"evald_token": token}).runtime) == ("42", None)
        assert sorted(runtimes.parties().values()) == [1, 4]
    finally:
        runtimes.close()
        evald.stop()


@pytest.fixture
def silent() -> Iterator[SilentAddress]:
    """The fault under test: an allowed address that accepts and never answers (a stand-in,
    engine_adapter.testing.SilentAddress)."""
    with SilentAddress() as address:
        yield address


def _flood(runtimes: TenantRuntimes, target: str, first: int, count: int) -> list[Any]:
    return [
        runtimes.for_request(
            {"evald_target": target, "evald_token": f"flood-{i:04d}-0123456789"}
        ).runtime
        for i in range(first, first + count)
    ]


def test_an_address_that_hangs_delays_no_other_addresss_checks(
    daemon: Daemon, silent: SilentAddress
) -> None:
    """A flood of new tokens naming an allowed address that accepts and never answers, before
    and after a real tenant's first request: the real tenant is accepted and its span answered
    while the hung address's first check still waits for its connection (given two minutes
    here, so that nothing but the real check can finish first). Before, one thread checked
    every token, newest first, 5 s each, and the real tenant's span had no value after 30 s."""
    runtimes = TenantRuntimes(
        AdapterConfig(daemon.target),
        CODEC,
        allowed=frozenset({daemon.target, silent.target}),
        connect_timeout_s=120.0,
        refresh_s=None,
    )
    try:
        flood = _flood(runtimes, silent.target, 0, 50)
        _until(lambda: silent.accepted >= 1, "the hung address's check connected")
        real = runtimes.for_request({"evald_token": TOKENS["alpha"]}).runtime
        flood += _flood(runtimes, silent.target, 50, 50)  # newer than the real tenant
        assert _value(real) == ("42", None)
        assert runtimes.stats["unreachable"] == 0 and not any(r.admitted for r in flood)
        assert len(runtimes) == 1
    finally:
        runtimes.close()
    assert all(r.refusal is not None for r in flood)  # closing answered every waiting one
    checkers = [t for t in threading.enumerate() if t.name.endswith(silent.target)]
    assert not any(t.is_alive() for t in checkers)  # closing ended the hung check's wait


def test_an_address_that_did_not_answer_is_answered_unavailable_for_a_while(
    daemon: Daemon, silent: SilentAddress
) -> None:
    """One check finds the address unreachable within its short connect timeout; it answers
    every tenant waiting there, and new ones are answered from that memory, without a check or
    a connection; the real daemon's tenants are checked as ever."""
    runtimes = TenantRuntimes(
        AdapterConfig(daemon.target),
        CODEC,
        allowed=frozenset({daemon.target, silent.target}),
        connect_timeout_s=0.5,
        unreachable_s=3600.0,
        refresh_s=None,
    )
    try:
        first = _flood(runtimes, silent.target, 0, 20)
        _until(lambda: all(r.admitted for r in first), "the hung address's check")
        later = _flood(runtimes, silent.target, 20, 20)
        for runtime in first + later:
            assert runtime.admitted and runtime.refusal is not None
            assert runtime.refusal[0] == ErrorCode.UNAVAILABLE
            assert "did not connect within 0.5 s" in runtime.refusal[1]
        assert runtimes.stats["unreachable"] == 1 and silent.accepted == 1
        assert runtimes.stats["unreachable_cached"] >= 20
        assert _value(runtimes.for_request({"evald_token": TOKENS["alpha"]}).runtime) == (
            "42",
            None,
        )
    finally:
        runtimes.close()


def test_a_request_to_another_address_gets_no_server_token(daemon: Daemon) -> None:
    asked: list[AdapterConfig] = []

    def check(config: AdapterConfig) -> EvaluatorListing:
        asked.append(config)
        return EvaluatorListing([], 1, "")

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

    def check(config: AdapterConfig) -> EvaluatorListing:
        gate.result(timeout=60)
        return tenant_listing(config.target, config.token)

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
