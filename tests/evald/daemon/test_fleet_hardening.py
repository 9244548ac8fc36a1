"""The fleet store holds against its own logins and its own rows, each against the real server
and real daemons.

The daemons' login cannot move the revision but forward by one, rewrite a registration or
write an audit row in another's name; a daemon that finds the store's revision gone back
raises an alarm instead of following it; a tenant row nested too deep costs only its tenant;
no login outside the two roles reaches the database, and a flood of notifications costs each
daemon a handful of reads; a daemon that cannot confirm it is current stops serving store
tenants after ``max_stale_s``; a store tenant cannot take over a config tenant's token.
"""

from __future__ import annotations

import hashlib
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import pytest
from daemon_harness import TOKENS, Daemon, module, outcome
from fleet_harness import (
    DAEMON_LOGIN,
    OPERATOR_LOGIN,
    Fleet,
    at_revision,
    client,
    head,
    local_tenant,
    until,
)
from psycopg import sql

from evald.client import CallError
from evald.daemon import STORE_HEALTH_SERVICE, hash_token

METRICS = ['metrics_listen = "127.0.0.1:{metrics_port}"']
#: The test cluster's superuser, the store's owner (as in fleet_harness).
OWNER = "evald_admin"


def _metric(daemon: Daemon, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics") as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _health(daemon: Daemon) -> str:
    return client(daemon, None).health(STORE_HEALTH_SERVICE)


def _lines(daemon: Daemon, message: str) -> list[dict[str, Any]]:
    return [line for line in daemon.log_lines() if line.get("msg") == message]


def _as(fleet: Fleet, user: str) -> psycopg.Connection[Any]:
    return psycopg.connect(fleet.url(user), password=fleet.server.logins[user], autocommit=True)


def _as_owner(fleet: Fleet) -> psycopg.Connection[Any]:
    return psycopg.connect(
        fleet.server.url(database=fleet.name), password=fleet.server.password, autocommit=True
    )


def test_the_daemons_login_cannot_move_the_head_rewrite_registrations_or_audit(
    fleet: Fleet,
) -> None:
    victim = fleet.add_tenant("victim")
    fleet.add_tenant("other")
    (daemon,) = fleet.start(1)
    theirs = client(daemon, victim).register(module("echo", "mine"))
    other_module = module("output", "mine", 2)
    other_sha = hashlib.sha256(other_module).hexdigest()
    victim_sha = hash_token(victim)  # the call's token: the store checks it names the tenant
    before = head(fleet)
    with _as(fleet, DAEMON_LOGIN) as conn:
        for statement in (
            "UPDATE evald.head SET revision = 0",
            "UPDATE evald.head SET revision = 9223372036854775807",
            "SELECT evald.begin_change()",
            "INSERT INTO evald.modules (sha256, bytes, size) VALUES (repeat('a', 64), '', 0)",
            f"UPDATE evald.evaluators SET sha256 = '{other_sha}' WHERE tenant = 'victim'",
            "INSERT INTO evald.evaluators (tenant, name, sha256, revision)"
            " VALUES ('victim', 'x', NULL, 1)",
            "INSERT INTO evald.changes (revision, actor, action, tenant, role)"
            " VALUES (999, 'alice', 'tenant.revoke', 'victim', 'ops')",
            "SELECT evald.record_change('alice', 'tenant.revoke', 'victim', NULL, NULL, NULL)",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement.encode())
        # Its one way to write checks the tenant's rules and the bytes' hash in the store.
        with pytest.raises(psycopg.Error, match="do not match its hash"):
            conn.execute(
                "SELECT evald.register_evaluator(%s, %s, %s, %s, %s, %s, %s, %s)",
                ("victim", "mine", "mine", theirs.sha256, other_module, "{}", True, victim_sha),
            )
    # Not even the owner moves the head but forward by one.
    with _as_owner(fleet) as conn, pytest.raises(psycopg.Error, match="forward by one"):
        conn.execute(b"UPDATE evald.head SET revision = 0")
    assert head(fleet) == before
    assert client(daemon, victim).evaluate("mine", b"still").value == "still"
    # What the daemons need still works, and the audit says which login made each change.
    fleet.add_tenant("later")
    revoked = fleet.cli("tenants", "revoke", "victim", "--all")
    assert revoked.returncode == 0, revoked.stderr
    log = fleet.operator.audit(10)
    assert [(row["action"], row["role"]) for row in log[:3]] == [
        ("tenant.revoke", OPERATOR_LOGIN),
        ("tenant.add", OPERATOR_LOGIN),
        ("evaluator.register", DAEMON_LOGIN),
    ]
    assert [row["revision"] for row in log] == list(range(head(fleet), 0, -1))


def test_a_head_below_the_applied_revision_is_an_alarm_not_a_rewind(fleet: Fleet) -> None:
    token = fleet.add_tenant("team")
    (daemon,) = fleet.start(1)
    client(daemon, token).register(module("echo", "kept"))
    applied = head(fleet)
    at_revision([daemon], token, applied)
    assert _health(daemon) == "SERVING"
    # A restore from an old backup, or a write outside evald, takes the revision back.
    with _as_owner(fleet) as conn:
        conn.execute(b"ALTER TABLE evald.head DISABLE TRIGGER head_moves_forward")
        conn.execute(b"UPDATE evald.head SET revision = 1")
        conn.execute(b"ALTER TABLE evald.head ENABLE TRIGGER head_moves_forward")
        conn.execute(b"NOTIFY evald_changes")
    until(lambda: _health(daemon) == "NOT_SERVING", "the store's health says the alarm")
    alarm = _lines(daemon, "fleet store revision went back")
    assert alarm and alarm[0]["head"] == 1 and alarm[0]["applied"] == applied, alarm
    assert client(daemon, token).revision() == applied  # nothing older applied
    assert client(daemon, token).evaluate("kept", b"served").value == "served"


def _write_limits_outside_evald(fleet: Fleet, tenant: str, limits_json: str) -> None:
    """What a login with the operators' rights can write by hand: any JSON PostgreSQL takes."""
    with _as(fleet, OPERATOR_LOGIN) as conn, conn.transaction():
        conn.execute(b"SELECT evald.begin_change()")
        conn.execute(
            b"UPDATE evald.tenants SET limits = %s::jsonb WHERE name = %s", (limits_json, tenant)
        )
        conn.execute(
            b"SELECT evald.record_change('by-hand', 'tenant.limits', %s, NULL, NULL, NULL)",
            (tenant,),
        )


def test_a_tenant_row_nested_too_deep_costs_only_its_tenant(fleet: Fleet) -> None:
    good = fleet.add_tenant("good")
    rotated = fleet.add_tenant("rotated")
    bad = fleet.add_tenant("bad")
    daemons = fleet.start(2)
    client(daemons[0], good).register(module("echo", "echo"))
    at_revision(daemons, good, head(fleet))
    _write_limits_outside_evald(fleet, "bad", '{"deadline_ms": ' * 3000 + "1" + "}" * 3000)
    # The change after it still reaches every daemon: a revocation.
    revoked = fleet.cli("tenants", "revoke", "rotated", "--all")
    assert revoked.returncode == 0, revoked.stderr
    at_revision(daemons, good, head(fleet))
    for daemon in daemons:
        for token in (rotated, bad):
            with pytest.raises(CallError) as refused:
                client(daemon, token).evaluate("calc", b"1+1")
            assert refused.value.code is not None
            assert refused.value.code.value == "permission_denied"
        assert client(daemon, good).evaluate("echo", b"ok").value == "ok"
        assert _health(daemon) == "SERVING"
        logged = _lines(daemon, "fleet store tenant not served")
        assert logged and logged[0]["tenant"] == "bad", logged
    # A new daemon starts and serves the rest.
    (fresh,) = fleet.start(1)
    assert client(fresh, good).evaluate("echo", b"new").value == "new"
    listed = fleet.cli("tenants", "list")
    assert listed.returncode == 0 and "unreadable" in listed.stdout, listed.stderr


def test_no_other_login_reaches_the_store_and_a_notify_flood_is_coalesced(fleet: Fleet) -> None:
    token = fleet.add_tenant("team")
    stranger = f"stranger_{fleet.name}"
    fleet.server.create_login(stranger, "pg_monitor")
    with pytest.raises(psycopg.OperationalError, match="permission denied for database"):
        psycopg.connect(fleet.url(stranger), password=fleet.server.logins[stranger]).close()

    (daemon,) = fleet.start(1, config=fleet.config(poll_s=60, extra=METRICS))
    reads = _metric(daemon, "evald_store_reads_total")
    sent = 3000
    with _as(fleet, OPERATOR_LOGIN) as conn:  # a login that may connect: one commit each
        for index in range(sent):
            conn.execute(b"SELECT pg_notify('evald_changes', %s)", (str(index),))
    fleet.add_tenant("after")
    at_revision([daemon], token, head(fleet))
    extra = _metric(daemon, "evald_store_reads_total") - reads
    assert 1 <= extra <= 100, f"{extra:.0f} reads for {sent} notifications"
    assert client(daemon, token).evaluate("calc", b"2+2").value == "4"


def test_past_max_stale_s_store_tenants_are_refused_and_config_tenants_served(
    fleet: Fleet,
) -> None:
    token = fleet.add_tenant("team")
    config = fleet.config(
        local_tenant("alpha", evaluators=["calc"]), poll_s=0.5, extra=METRICS
    ).replace("connect_timeout_s = 5", "connect_timeout_s = 5\nmax_stale_s = 2")
    (daemon,) = fleet.start(1, config=config)
    until(lambda: _metric(daemon, "evald_store_revision_age_seconds") <= 2, "a fresh revision")
    assert client(daemon, token).evaluate("calc", b"1+1").value == "2"

    def refused_stale() -> bool:
        answer = client(daemon, token).evaluate("calc", b"1+1")
        return outcome(answer) == "unavailable" and "stale" in answer.error.message

    fleet.server.stop()
    try:
        until(refused_stale, "the store tenant refused as stale")
        assert _metric(daemon, "evald_store_revision_age_seconds") > 2
        alpha = daemon.client("alpha")
        assert alpha.evaluate("calc", b"3+3").value == "6"  # the config's own tenant
        # A restart from a cache confirmed long ago refuses at once, before any read.
        daemon.kill()
        cache = daemon.state_dir / "fleet.json"
        an_hour_ago = time.time() - 3600
        os.utime(cache, (an_hour_ago, an_hour_ago))
        daemon = fleet.restart(daemon)
        assert refused_stale()
        assert daemon.client("alpha").evaluate("calc", b"4+4").value == "8"
    finally:
        fleet.server.start()
    until(lambda: outcome(client(daemon, token).evaluate("calc", b"1+1")) == "ok", "served")


def test_a_store_tenant_cannot_take_over_a_config_tenants_token(fleet: Fleet) -> None:
    config = fleet.config(local_tenant("alpha", evaluators=["calc"]))
    path = fleet.root / "daemons.toml"
    path.write_text(config)
    taken = hash_token(TOKENS["alpha"])
    refused = fleet.cli("tenants", "add", "thief", "--token-sha256", taken, "--config", str(path))
    assert refused.returncode != 0 and "'alpha'" in refused.stderr, refused.stderr

    (daemon,) = fleet.start(1, config=config)
    # A login with the operators' rights, but no CLI: the row goes in anyway.
    fleet.operator.add_tenant(
        "tests", "thief", [taken], limits={}, evaluators=[], may_register=False, max_modules=0
    )
    honest = fleet.add_tenant("honest")
    at_revision([daemon], honest, head(fleet))
    alpha = daemon.client("alpha")
    assert alpha.evaluate("calc", b"5+5").value == "10"  # still alpha's: thief may use nothing
    logged = _lines(daemon, "fleet store tenant not served")
    assert logged and logged[0]["tenant"] == "thief", logged
    assert logged[0]["config_tenant"] == "alpha"
    rows = fleet.server.execute(
        sql.SQL("SELECT name FROM evald.tenants ORDER BY name"), database=fleet.name
    )
    assert rows == [("honest",), ("thief",)]


def test_store_init_upgrades_a_version_1_store_in_place(fleet: Fleet) -> None:
    token = f"old-token-{os.urandom(4).hex()}"
    kept = module("echo", "kept")
    kept_sha = hashlib.sha256(kept).hexdigest()
    with _as_owner(fleet) as conn:  # the store as the first release left it, with its rows
        conn.execute(b"DROP SCHEMA evald CASCADE")
        conn.execute((Path(__file__).parent / "fleet_schema_v1.sql").read_bytes())
        conn.execute(b"UPDATE evald.head SET revision = 2")
        conn.execute(
            b"INSERT INTO evald.tenants (name, token_sha256s, evaluators, may_register,"
            b" revision) VALUES ('old', ARRAY[%s], '{*}', true, 1)",
            (hash_token(token),),
        )
        conn.execute(
            b"INSERT INTO evald.modules (sha256, bytes, size) VALUES (%s, %s, %s)",
            (kept_sha, kept, len(kept)),
        )
        conn.execute(
            b"INSERT INTO evald.evaluators (tenant, name, sha256, tag, manifest, revision)"
            b" VALUES ('old', 'kept', %s, 'kept', '{}', 2)",
            (kept_sha,),
        )
        conn.execute(
            b"INSERT INTO evald.changes (revision, actor, action, tenant) VALUES"
            b" (1, 'alice', 'tenant.add', 'old'), (2, 'old', 'evaluator.register', 'old')"
        )
    with _as(fleet, DAEMON_LOGIN) as conn:  # what version 1 let every pod do
        conn.execute(b"UPDATE evald.head SET revision = revision")

    upgraded = fleet.cli("store", "init", user=OWNER)
    assert upgraded.returncode == 0, upgraded.stderr
    assert "upgraded from schema version 1" in upgraded.stdout, upgraded.stdout
    with _as(fleet, DAEMON_LOGIN) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(b"UPDATE evald.head SET revision = revision")
    assert fleet.server.execute(
        sql.SQL("SELECT tenant, sha256 FROM evald.uploads"), database=fleet.name
    ) == [("old", kept_sha)]
    (daemon,) = fleet.start(1)
    assert client(daemon, token).evaluate("kept", b"still").value == "still"
    client(daemon, token).register(module("echo", "new"))
    assert head(fleet) == 3
    assert fleet.operator.audit(1)[0]["role"] == DAEMON_LOGIN
    again = fleet.cli("store", "init", user=OWNER)
    assert again.returncode == 0 and "upgraded" not in again.stdout, again.stdout
    assert head(fleet) == 3
    assert client(daemon, token).evaluate("new", b"both").value == "both"
