"""The fleet's control plane off one thread: real daemons following a real PostgreSQL.

1. A revocation reaches a daemon while that daemon compiles another tenant's module fetched
   from the store (it was applied after the compile: 5.6 s on every daemon).
2. A registration sent with a token the operator revokes while it compiles fails
   ``permission_denied`` and changes nothing (it committed after the revocation and replaced
   the tenant's evaluator on every daemon).
3. A manifest holding ``\\u0000`` is ``invalid_module`` (PostgreSQL cannot store it: the write
   failed and the caller was told ``unavailable ... retry``).

A compile that runs as long as a test needs is the daemon's real compile worker stopped with
SIGSTOP; every wait reads what the daemons decided (their answers, their log lines).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from daemon_harness import Daemon, module, outcome
from fleet_harness import Fleet, at_revision, client, head, until

from evald.client import CallError, Client
from evald.testing import guest, manifest_bytes, process_alive, process_descendants

#: A stopped compile worker must not reach its wall-clock limit during a test.
_SLOW_COMPILES_OK = ["compile_timeout_s = 120"]


@contextmanager
def _stalled_worker(daemon: Daemon) -> Iterator[int]:
    """The daemon's compile worker (a fleet daemon starts it at once), stopped until the block
    ends."""

    def workers() -> list[int]:
        found = process_descendants(daemon.pid).items()
        return [pid for pid, cmd in found if "spawn_main" in cmd]

    until(lambda: len(workers()) == 1, "the compile worker started")
    worker = workers()[0]
    os.kill(worker, signal.SIGSTOP)
    try:
        yield worker
    finally:
        if process_alive(worker):
            os.kill(worker, signal.SIGCONT)


def _refused(probe: Client) -> bool:
    try:
        probe.evaluate("calc", "1+1")
    except CallError as error:
        return error.code is not None and error.code.value == "permission_denied"
    return False


def test_a_revocation_applies_while_the_daemon_compiles_a_module_from_the_store(
    fleet: Fleet,
) -> None:
    team = fleet.add_tenant("team")
    other = fleet.add_tenant("other")
    daemons = fleet.start(2, config=fleet.config(extra=_SLOW_COMPILES_OK))
    registrar, follower = daemons
    assert client(follower, other).evaluate("calc", "1+1").value == "2"
    with _stalled_worker(follower):
        client(registrar, team).register(module("echo", "fresh"))
        # the follower fetched it and is compiling it: its tenant's names answer "loading"
        until(
            lambda: outcome(client(follower, team).evaluate("fresh", b"x")) == "unavailable",
            "fresh loading on the follower",
        )
        revoked = fleet.cli("tenants", "revoke", "other", "--all")
        assert revoked.returncode == 0, revoked.stderr
        until(lambda: _refused(client(follower, other)), "the revocation applied")
        # still compiling: the module is not served yet, and no later revision is reported
        assert outcome(client(follower, team).evaluate("fresh", b"x")) == "unavailable"
        assert client(follower, team).revision() < head(fleet)
    at_revision([follower], team, head(fleet))
    assert client(follower, team).evaluate("fresh", b"served").value == "served"


def test_a_registration_whose_token_is_revoked_while_it_compiles_changes_nothing(
    fleet: Fleet,
) -> None:
    stolen = fleet.add_tenant("team")
    rotated = fleet.cli("tenants", "rotate", "team")
    assert rotated.returncode == 0, rotated.stderr
    kept = rotated.stdout.splitlines()[1]
    daemons = fleet.start(2, config=fleet.config(extra=_SLOW_COMPILES_OK))
    first = client(daemons[0], kept).register(module("echo", "target"))
    at_revision(daemons, kept, head(fleet))

    outcome_of: dict[str, str] = {}

    def register_with_the_stolen_token() -> None:
        thief = Client(daemons[0].target, stolen, timeout_s=120.0)
        try:
            thief.register(module("payload", "target", (b"taken", False)), replace=True)
            outcome_of["code"] = "registered"
        except CallError as error:
            outcome_of["code"] = error.code.value if error.code is not None else "unreachable"
            outcome_of["message"] = str(error)
        finally:
            thief.close()

    with _stalled_worker(daemons[0]):
        thread = threading.Thread(target=register_with_the_stolen_token, daemon=True)
        thread.start()
        until(
            lambda: any(
                line.get("msg") == "registration compiling" and line.get("turn") == 2
                for line in daemons[0].log_lines()
            ),
            "the stolen registration compiling",
        )
        revoked = fleet.cli("tenants", "revoke", "team", "--old")
        assert revoked.returncode == 0, revoked.stderr
        until(lambda: _refused(client(daemons[0], stolen)), "the revocation applied")
        assert thread.is_alive()  # still compiling
    thread.join(timeout=120)
    assert outcome_of.get("code") == "permission_denied", outcome_of
    revision = head(fleet)
    assert fleet.operator.audit(1)[0]["action"] != "evaluator.register"
    at_revision(daemons, kept, revision)
    for daemon in daemons:
        listed = {info.name: info.sha256 for info in client(daemon, kept).list_evaluators()}
        assert listed["target"] == first.sha256
        assert client(daemon, kept).evaluate("target", b"mine").value == "mine"


def test_a_manifest_holding_a_nul_is_an_invalid_module_not_an_outage(fleet: Fleet) -> None:
    token = fleet.add_tenant("team")
    (daemon,) = fleet.start(1)
    manifest = json.loads(manifest_bytes(name="nul", tag="nul", semantics_version="nul/1"))
    manifest["description"] = "before\u0000after"
    with pytest.raises(CallError) as refused:
        client(daemon, token).register(guest("echo", manifest=json.dumps(manifest).encode()))
    assert refused.value.code is not None
    assert refused.value.code.value == "invalid_module", str(refused.value)
    assert "NUL" in str(refused.value) and "description" in str(refused.value)
    assert client(daemon, token).evaluate("calc", "1+1").value == "2"
