"""Tenants stay apart in the fleet store, and each database role can do only what it needs.

A second tenant tries to read, replace and delete the first one's module through every API, on
every daemon; the daemons' login (``evald_daemon``) and the operators' (``evald_operator``) try
every write they are not meant to make, against the real server.
"""

from __future__ import annotations

import psycopg
import pytest
from daemon_harness import module, outcome
from fleet_harness import DAEMON_LOGIN, OPERATOR_LOGIN, Fleet, at_revision, client, head

from evald.client import CallError


def test_a_tenant_changes_only_its_own_modules_on_any_daemon(fleet: Fleet) -> None:
    owner = fleet.add_tenant("owner")
    intruder = fleet.add_tenant("intruder")
    daemons = fleet.start(2)
    mine = client(daemons[0], owner).register(module("echo", "private"))
    at_revision(daemons, owner, head(fleet))
    for daemon in daemons:
        other = client(daemon, intruder)
        assert "private" not in {item.name for item in other.list_evaluators()}
        assert outcome(other.evaluate("private", b"x")) == "unknown_evaluator"
        with pytest.raises(CallError) as deleted:
            other.delete("private")
        assert deleted.value.code is not None and deleted.value.code.value == "unknown_evaluator"
    # Replacing "private" makes the intruder a module of its own; the owner's is untouched.
    theirs = client(daemons[1], intruder).register(module("output", "private", 2), replace=True)
    assert theirs.sha256 != mine.sha256
    at_revision(daemons, owner, head(fleet))
    for daemon in daemons:
        assert client(daemon, owner).evaluate("private", b"mine").value == "mine"
        listed = {item.name: item.sha256 for item in client(daemon, owner).list_evaluators()}
        assert listed["private"] == mine.sha256
    rows = fleet.operator.tenants()
    assert {row["name"]: row["modules"] for row in rows} == {"intruder": 1, "owner": 1}


def _denied(fleet: Fleet, user: str, statement: str) -> None:
    password = fleet.server.logins[user]
    with psycopg.connect(fleet.url(user), password=password, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(statement.encode())


def test_each_role_can_do_only_what_it_needs(fleet: Fleet) -> None:
    fleet.add_tenant("owner")
    for statement in (
        "UPDATE evald.tenants SET token_sha256s = '{}'",
        "INSERT INTO evald.tenants (name, revision) VALUES ('mine', 1)",
        "UPDATE evald.evaluators SET tenant = 'other'",
        "DELETE FROM evald.evaluators",
        "UPDATE evald.modules SET bytes = ''",
        "DELETE FROM evald.modules",
        "DELETE FROM evald.changes",
        "UPDATE evald.changes SET actor = 'nobody'",
        "TRUNCATE evald.changes",
        "DROP TABLE evald.changes",
    ):
        _denied(fleet, DAEMON_LOGIN, statement)
    for statement in (
        "INSERT INTO evald.modules (sha256, bytes, size) VALUES (repeat('0', 64), '', 0)",
        "UPDATE evald.evaluators SET sha256 = NULL",
        "DELETE FROM evald.tenants",
        "DELETE FROM evald.changes",
    ):
        _denied(fleet, OPERATOR_LOGIN, statement)
    # What each needs works: the daemon reads everything it serves.
    password = fleet.server.logins[DAEMON_LOGIN]
    with psycopg.connect(fleet.url(DAEMON_LOGIN), password=password) as conn:
        assert conn.execute(b"SELECT count(*) FROM evald.tenants").fetchone() == (1,)
    # A tenant's change needs the operator credential: the daemons' login is refused.
    refused = fleet.cli("tenants", "add", "sneaky", user=DAEMON_LOGIN)
    assert refused.returncode != 0 and "permission" in refused.stderr.lower(), refused.stderr
    added = fleet.cli("tenants", "add", "proper")
    assert added.returncode == 0, added.stderr
