"""The fleet store's faults, each against the real server: nothing is lost, no daemon stops
serving.

PostgreSQL stopped, started again, a daemon killed -9 and restarted while it is down, a
corrupt cache entry, a module row whose bytes do not match its hash, a listener connection cut
while changes go on, SQL in names, manifests and tokens, and the password kept out of every
log line, metric and error.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from daemon_harness import Daemon, module, outcome
from fleet_harness import DAEMON_LOGIN, Fleet, at_revision, client, head, until
from psycopg import sql

from evald.client import CallError
from evald.daemon import STORE_HEALTH_SERVICE, hash_token
from evald.testing import guest, manifest_bytes

METRICS = ['metrics_listen = "127.0.0.1:{metrics_port}"']


def _health(daemon: Daemon) -> str:
    return client(daemon, None).health(STORE_HEALTH_SERVICE)


def _metric(daemon: Daemon, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics") as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _lines(daemon: Daemon, message: str) -> list[dict[str, object]]:
    return [line for line in daemon.log_lines() if line.get("msg") == message]


def test_store_down_daemons_serve_degraded_refuse_registrations_then_catch_up(
    fleet: Fleet,
) -> None:
    token = fleet.add_tenant("team")
    daemons = fleet.start(2, config=fleet.config(extra=METRICS))
    client(daemons[0], token).register(module("echo", "kept"))
    at_revision(daemons, token, head(fleet))
    before = head(fleet)

    fleet.server.stop()
    try:
        for daemon in daemons:
            until(lambda daemon=daemon: _health(daemon) == "NOT_SERVING", "degraded")
            assert _metric(daemon, "evald_store_connected") == 0
            assert client(daemon, token).health() == "SERVING"
            assert client(daemon, token).evaluate("kept", b"still").value == "still"
        with pytest.raises(CallError) as refused:
            client(daemons[1], token).register(module("echo", "lost"))
        assert refused.value.code is not None and refused.value.code.value == "unavailable"
        assert "nothing was changed" in refused.value.message
    finally:
        fleet.server.start()

    for daemon in daemons:
        until(lambda daemon=daemon: _health(daemon) == "SERVING", "reachable again")
        assert _metric(daemon, "evald_store_connected") == 1
    # Nothing half-written: no row, no revision, not served anywhere.
    assert head(fleet) == before
    assert fleet.server.execute(
        sql.SQL("SELECT count(*) FROM evald.evaluators WHERE name = 'lost'"), database=fleet.name
    ) == [(0,)]
    for daemon in daemons:
        assert outcome(client(daemon, token).evaluate("lost", b"x")) == "unknown_evaluator"
    # Caught up without a restart: a change made now reaches every daemon.
    client(daemons[1], token).register(module("echo", "after"))
    at_revision(daemons, token, head(fleet))
    for daemon in daemons:
        assert client(daemon, token).evaluate("after", b"ok").value == "ok"


def test_a_daemon_killed_and_restarted_while_the_store_is_down_serves_its_cache(
    fleet: Fleet,
) -> None:
    token = fleet.add_tenant("team", limits={"input_bytes": 64})
    (daemon,) = fleet.start(1)
    client(daemon, token).register(module("echo", "cached"))
    at_revision([daemon], token, head(fleet))
    daemon.kill()
    fleet.server.stop()
    try:
        daemon = fleet.restart(daemon)
        assert client(daemon, token).evaluate("cached", b"from cache").value == "from cache"
        assert outcome(client(daemon, token).evaluate("cached", b"x" * 65)) == "input_too_large"
        assert _health(daemon) == "NOT_SERVING"
        assert _lines(daemon, "fleet store unreachable at start: serving the local cache")
    finally:
        fleet.server.start()
    until(lambda: _health(daemon) == "SERVING", "reachable again")


def test_a_corrupt_cache_entry_is_refused_and_fetched_again(fleet: Fleet) -> None:
    token = fleet.add_tenant("team")
    (daemon,) = fleet.start(1)
    info = client(daemon, token).register(module("echo", "mine"))
    at_revision([daemon], token, head(fleet))
    assert daemon.stop() == 0
    cached = daemon.state_dir / "modules" / f"{info.sha256}.wasm"
    cached.write_bytes(cached.read_bytes()[:-1] + b"!")

    daemon = fleet.restart(daemon)
    assert client(daemon, token).evaluate("mine", b"good").value == "good"
    refused = _lines(daemon, "cached module refused; fetching it again")
    assert len(refused) == 1 and "do not match" in str(refused[0]["error"]), refused
    import hashlib

    assert hashlib.sha256(cached.read_bytes()).hexdigest() == info.sha256  # repaired


def test_a_module_row_whose_bytes_do_not_match_its_hash_is_not_served(fleet: Fleet) -> None:
    token = fleet.add_tenant("team")
    (first,) = fleet.start(1)
    info = client(first, token).register(module("echo", "tampered"))
    fleet.server.execute(
        sql.SQL("UPDATE evald.modules SET bytes = %s WHERE sha256 = %s"),
        (module("output", "tampered", 2), info.sha256),
        database=fleet.name,
    )
    (fresh,) = fleet.start(1)  # no cache: it must fetch the row
    assert outcome(client(fresh, token).evaluate("tampered", b"x")) == "unknown_evaluator"
    refused = _lines(fresh, "registered module not served")
    assert len(refused) == 1 and "do not match its hash" in str(refused[0]["error"]), refused
    # The daemon that registered it serves the bytes it checked.
    assert client(first, token).evaluate("tampered", b"x").value == "x"


def test_a_daemon_whose_listener_is_cut_catches_up_missing_nothing_applying_nothing_twice(
    fleet: Fleet,
) -> None:
    token = fleet.add_tenant("team")
    writer, follower = fleet.start(2, config=fleet.config(poll_s=60))  # notifications only
    start = head(fleet)
    for index in range(5):
        fleet.server.execute(
            sql.SQL(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s"
            ),
            (f"evald-{follower.pid}-listen",),
        )
        client(writer, token).register(module("echo", f"m{index}"))
    last = head(fleet)
    at_revision([follower], token, last)
    names = {item.name for item in client(follower, token).list_evaluators()}
    assert {f"m{index}" for index in range(5)} <= names

    def logged() -> list[int]:
        return [
            revision
            for line in _lines(follower, "store revision applied")
            for revision in line["revisions"]  # type: ignore[union-attr]
        ]

    # The daemon serves a revision, then writes its cache and logs it: wait for the log line.
    until(lambda: last in logged(), f"the follower's log line for revision {last}")
    expected = list(range(start + 1, last + 1))
    applied = logged()
    assert [r for r in applied if r > start] == expected, applied  # each once, in order
    assert _lines(follower, "fleet store unreachable")  # the cuts were seen


def test_sql_in_names_manifests_and_tokens_is_stored_as_data(fleet: Fleet) -> None:
    token = fleet.add_tenant("team")
    daemons = fleet.start(2)
    bad_name = fleet.cli("tenants", "add", "x'; DROP TABLE evald.tenants; --")
    assert bad_name.returncode != 0 and "tenant name" in bad_name.stderr
    description = "'); DELETE FROM evald.modules; DROP TABLE evald.changes; --"
    wasm = guest(
        "echo",
        manifest=manifest_bytes(
            name="quoted", tag="quoted", semantics_version="quoted/1", description=description
        ),
    )
    client(daemons[0], token).register(wasm)
    at_revision(daemons, token, head(fleet))
    listed = {item.name: item for item in client(daemons[1], token).list_evaluators()}
    assert listed["quoted"].description == description
    stored = fleet.server.execute(
        sql.SQL("SELECT manifest FROM evald.evaluators WHERE name = 'quoted'"),
        database=fleet.name,
    )
    assert stored[0][0]["description"] == description
    with pytest.raises(CallError) as refused:
        client(daemons[1], "' OR 1=1; --").evaluate("quoted", b"x")
    assert refused.value.code is not None and refused.value.code.value == "permission_denied"
    revoke = fleet.cli("tenants", "revoke", "team", "--token", "'; DELETE FROM evald.tenants; --")
    assert revoke.returncode == 0 and "revoked 0 token(s)" in revoke.stdout, revoke.stderr
    assert client(daemons[1], token).evaluate("quoted", b"still").value == "still"
    counts = fleet.server.execute(
        sql.SQL(
            "SELECT (SELECT count(*) FROM evald.tenants), (SELECT count(*) FROM evald.changes)"
        ),
        database=fleet.name,
    )
    assert counts[0][0] == 1 and counts[0][1] >= 3
    assert hash_token(token) in str(
        fleet.server.execute(
            sql.SQL("SELECT token_sha256s FROM evald.tenants"), database=fleet.name
        )
    )


def test_the_password_never_reaches_a_log_line_a_metric_or_an_error(fleet: Fleet) -> None:
    password = fleet.server.logins[DAEMON_LOGIN]
    token = fleet.add_tenant("team")
    (daemon,) = fleet.start(1, config=fleet.config(extra=METRICS))
    fleet.server.stop()
    try:
        until(lambda: _health(daemon) == "NOT_SERVING", "degraded")
        with pytest.raises(CallError) as refused:
            client(daemon, token).register(module("echo", "never"))
        assert password not in refused.value.message
    finally:
        fleet.server.start()
    wrong = fleet.root / "wrong.password"
    wrong.write_text("not-" + password + "\n")
    config = fleet.config().replace(str(fleet.server.password_file(DAEMON_LOGIN)), str(wrong))
    (locked_out,) = fleet.start(1, config=config)
    assert _health(locked_out) == "NOT_SERVING"
    for handle in (daemon, locked_out):
        log = handle.log_path.read_text()
        assert password not in log
        assert "password" in log.lower() or "unreachable" in log  # the failure is said
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics") as reply:
        assert password not in reply.read().decode()
    listed = fleet.cli("tenants", "list", "--json", user=DAEMON_LOGIN)
    assert listed.returncode == 0 and password not in listed.stdout + listed.stderr
    assert json.loads(listed.stdout)[0]["name"] == "team"
