"""The fleet store: several real daemons following one real PostgreSQL.

Tenants, tokens, limits and modules live in the store; every change is live on every daemon
without a restart. A test waits for what the daemons decided (the revision each reports in
ListEvaluators), never for a time.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from daemon_harness import module, outcome
from fleet_harness import Fleet, at_revision, client, head, one_item, open_stream

from evald.client import CallError, DataCallError, DataConnection


def test_a_registration_serves_on_every_daemon_and_a_deletion_everywhere(fleet: Fleet) -> None:
    token = fleet.add_tenant("team")
    daemons = fleet.start(3)
    info = client(daemons[0], token).register(module("echo", "shared"))
    at_revision(daemons, token, head(fleet))
    for daemon in daemons:
        listed = {item.name: item.sha256 for item in client(daemon, token).list_evaluators()}
        assert listed["shared"] == info.sha256
        assert client(daemon, token).evaluate("shared", b"hi").value == "hi"
    revisions = {client(daemon, token).revision() for daemon in daemons}
    assert len(revisions) == 1

    client(daemons[1], token).delete("shared")
    at_revision(daemons, token, head(fleet))
    for daemon in daemons:
        assert outcome(client(daemon, token).evaluate("shared", b"hi")) == "unknown_evaluator"
    log = fleet.operator.audit(10)
    assert [row["action"] for row in log[:2]] == ["evaluator.delete", "evaluator.register"]
    assert log[0]["tenant"] == "team" and log[0]["role"] == "pod"


def test_tokens_rotate_with_no_gap_and_a_revoked_one_ends_open_calls(fleet: Fleet) -> None:
    old = fleet.add_tenant("team")
    other = fleet.add_tenant("other")
    daemons = fleet.start(3, config=fleet.config(extra=['data_listen = "unix:{root}/data.sock"']))
    client(daemons[0], old).register(module("echo", "echo"))
    at_revision(daemons, old, head(fleet))

    rotated = fleet.cli("tenants", "rotate", "team")
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.splitlines()[1]
    at_revision(daemons, old, head(fleet))
    for daemon in daemons:  # both work: no gap
        assert client(daemon, old).evaluate("echo", b"a").value == "a"
        assert client(daemon, new).evaluate("echo", b"b").value == "b"

    # Open calls with the old token on every transport, and one of another tenant's.
    outgoing, responses = open_stream(daemons[1], old)
    outgoing.put(one_item("echo", b"before", "1"))
    assert next(responses).results[0].value == "before"
    data_target = f"unix:{daemons[2].config_path.parent}/data.sock"
    data = DataConnection.connect(data_target, old)
    data.send(one_item("echo", b"before", "1"))
    assert data.receive() is not None
    bystander, bystander_responses = open_stream(daemons[1], other)

    revoked = fleet.cli("tenants", "revoke", "team", "--old")
    assert revoked.returncode == 0, revoked.stderr
    at_revision(daemons, new, head(fleet))
    for daemon in daemons:
        with pytest.raises(CallError) as refused:
            client(daemon, old).evaluate("echo", b"x")
        assert refused.value.code is not None and refused.value.code.value == "permission_denied"
        assert client(daemon, new).evaluate("echo", b"c").value == "c"
    with pytest.raises(grpc.RpcError) as ended:
        next(responses)
    assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert dict(ended.value.trailing_metadata())["evald-error-code"] == "unauthenticated"
    with pytest.raises(DataCallError) as cut:
        while data.receive() is not None:
            pass
    assert cut.value.code.value == "unauthenticated"
    data.close()
    # The other tenant's stream is untouched.
    bystander.put(one_item("calc", b"1+1", "b"))
    assert next(bystander_responses).results[0].value == "2"
    bystander.put(None)
    outgoing.put(None)


def test_a_limits_change_applies_to_the_next_call(fleet: Fleet) -> None:
    token = fleet.add_tenant("team")
    daemons = fleet.start(2)
    client(daemons[0], token).register(module("echo", "echo"))
    at_revision(daemons, token, head(fleet))
    assert outcome(client(daemons[1], token).evaluate("echo", b"x" * 100)) == "ok"
    changed = fleet.cli("tenants", "limits", "team", "--limit", "input_bytes=10")
    assert changed.returncode == 0, changed.stderr
    at_revision(daemons, token, head(fleet))
    for daemon in daemons:
        assert outcome(client(daemon, token).evaluate("echo", b"x" * 100)) == "input_too_large"
        assert outcome(client(daemon, token).evaluate("echo", b"x" * 10)) == "ok"


def test_two_registrations_of_one_name_at_once_one_wins_and_all_converge(fleet: Fleet) -> None:
    token = fleet.add_tenant("team")
    daemons = fleet.start(3)
    modules = [module("echo", "same"), module("output", "same", 2)]
    results: list[object] = [None, None]
    start = threading.Barrier(2)

    def register(index: int) -> None:
        start.wait()
        try:
            results[index] = client(daemons[index], token).register(modules[index])
        except CallError as error:
            results[index] = error

    threads = [threading.Thread(target=register, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    won = [r for r in results if not isinstance(r, CallError)]
    lost = [r for r in results if isinstance(r, CallError)]
    assert len(won) == 1 and len(lost) == 1, results
    assert lost[0].code is not None and lost[0].code.value == "invalid_argument"
    at_revision(daemons, token, head(fleet))
    winner = won[0].sha256  # type: ignore[attr-defined]
    for daemon in daemons:
        listed = {item.name: item.sha256 for item in client(daemon, token).list_evaluators()}
        assert listed["same"] == winner
