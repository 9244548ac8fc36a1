"""Fair worker dispatch: a tenant at its ``max_running`` cap leaves workers for the others.

A daemon of its own (two workers) with an attacker tenant whose every call loops until its
deadline and a victim tenant. The assertions are about order, not speed: the victim's call must
come back while most of the attacker's calls, admitted before it, are still pending.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from daemon_harness import Daemon, free_port, module, outcome, start_daemon

from evald.client import Client
from evald.daemon import ConfigError, hash_token, parse_config

ATTACKER_TOKEN = "fairness-attacker-token-0123"
VICTIM_TOKEN = "fairness-victim-token-0123"
#: Each attacker item loops until this deadline (fuel metering is off for the attacker).
LOOP_DEADLINE_MS = 300
ATTACKER_ITEMS = 8


def _config(metrics_port: int) -> str:
    return f"""
[server]
threads = 2
metrics_listen = "127.0.0.1:{metrics_port}"
shutdown_grace_s = 5

[[tenants]]
name = "attacker"
token_sha256 = "{hash_token(ATTACKER_TOKEN)}"
allow_register = true
[tenants.limits]
fuel = 0
deadline_ms = {LOOP_DEADLINE_MS}

[[tenants]]
name = "victim"
token_sha256 = "{hash_token(VICTIM_TOKEN)}"
allow_register = true
"""


@pytest.fixture(scope="module")
def fair_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    port = free_port()
    handle = start_daemon(tmp_path_factory.mktemp("fair"), _config(port), metrics_port=port)
    try:
        yield handle
    finally:
        assert handle.stop() == 0, handle.log_path.read_text()


def _inflight(daemon: Daemon, tenant: str) -> float:
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    match = re.search(
        rf'^evald_inflight_evaluations\{{tenant="{tenant}"\}} (\S+)$', text, re.MULTILINE
    )
    assert match, text
    return float(match.group(1))


def _wait_admitted(daemon: Daemon, tenant: str, count: int) -> None:
    """Waits until ``count`` of the tenant's evaluations are admitted (queued or running)."""
    give_up = time.monotonic() + 30
    while _inflight(daemon, tenant) < count:
        assert time.monotonic() < give_up, f"{tenant} never had {count} evaluations in flight"
        time.sleep(0.01)


def _pending(futures: list[Future[object]]) -> int:
    return sum(not future.done() for future in futures)


def test_a_tenant_at_its_cap_leaves_a_worker_for_another(fair_daemon: Daemon) -> None:
    attacker = Client(fair_daemon.target, ATTACKER_TOKEN, timeout_s=60)
    victim = Client(fair_daemon.target, VICTIM_TOKEN, timeout_s=60)
    try:
        attacker.register(module("loop", "fair_loop"))
        victim.register(module("echo", "fair_echo"))
        # Separate calls, as many noisy clients would send them: before per-tenant dispatch
        # they queued FIFO ahead of the victim's call and held both workers.
        with ThreadPoolExecutor(ATTACKER_ITEMS) as senders:
            futures: list[Future[object]] = [
                senders.submit(attacker.evaluate, "fair_loop", b"") for _ in range(ATTACKER_ITEMS)
            ]
            _wait_admitted(fair_daemon, "attacker", ATTACKER_ITEMS)
            answer = victim.evaluate("fair_echo", b"my turn")
            pending_at_answer = _pending(futures)
            attacker_outcomes = [outcome(future.result()) for future in futures]
        assert outcome(answer) == "ok" and answer.value == "my turn"
        # The attacker holds one worker (max_running defaults to threads - 1), so its calls
        # finish one at a time; the victim ran on the other worker without waiting for them.
        assert pending_at_answer >= ATTACKER_ITEMS - 2, pending_at_answer
        assert attacker_outcomes == ["deadline_exceeded"] * ATTACKER_ITEMS

        # The same holds for one big batch: its items wait in the attacker's queue.
        with ThreadPoolExecutor(1) as sender:
            batch = sender.submit(attacker.evaluate_batch, [("fair_loop", b"")] * ATTACKER_ITEMS)
            _wait_admitted(fair_daemon, "attacker", ATTACKER_ITEMS)
            answer = victim.evaluate("fair_echo", b"again")
            batch_pending = not batch.done()
            batch_outcomes = [outcome(result) for result in batch.result()]
        assert outcome(answer) == "ok" and answer.value == "again"
        assert batch_pending
        assert batch_outcomes == ["deadline_exceeded"] * ATTACKER_ITEMS
    finally:
        attacker.close()
        victim.close()


def test_an_item_queued_behind_the_cap_still_gets_its_whole_deadline(fair_daemon: Daemon) -> None:
    attacker = Client(fair_daemon.target, ATTACKER_TOKEN, timeout_s=60)
    try:
        attacker.register(module("loop", "fair_queue_loop"))
        # One worker for the attacker: the second item waits behind the first, which runs for
        # the whole deadline. The deadline bounds running time, not time in the queue (as for
        # any large batch), so the second still runs and is stopped by its own deadline.
        results = attacker.evaluate_batch([("fair_queue_loop", b"")] * 2)
        assert [outcome(result) for result in results] == ["deadline_exceeded"] * 2
        for result in results:
            assert result.eval_time_us >= LOOP_DEADLINE_MS * 1000 * 0.8, result
    finally:
        attacker.close()


def test_max_running_config() -> None:
    base = f'[[tenants]]\nname = "t"\ntoken_sha256 = "{hash_token("t-token")}"\n'
    default = parse_config(base).tenants[0].limits
    assert default.max_running == 0
    assert default.running_cap(1) == 1
    assert default.running_cap(2) == 1
    assert default.running_cap(16) == 15
    # A daemon with one tenant keeps no worker back: nobody else could use it.
    assert default.running_cap(2, shared=False) == 2
    assert default.running_cap(16, shared=False) == 16
    explicit = parse_config(base + "[tenants.limits]\nmax_running = 3\n").tenants[0].limits
    assert explicit.running_cap(2) == 3 and explicit.running_cap(16) == 3
    inherited = parse_config("[defaults.limits]\nmax_running = 2\n" + base).tenants[0].limits
    assert inherited.max_running == 2
    for bad in ("-1", '"2"', "true", "1.5"):
        with pytest.raises(ConfigError, match=r"max_running"):
            parse_config(base + f"[tenants.limits]\nmax_running = {bad}\n")


def test_packaged_default_documents_max_running() -> None:
    from evald.daemon import DEFAULT_CONFIG_PATH

    text = Path(DEFAULT_CONFIG_PATH).read_text()
    assert re.search(r"^max_running = 0\b", text, re.MULTILINE)
