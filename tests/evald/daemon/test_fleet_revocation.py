"""A revocation committed in the fleet store is never missed by a change a daemon commits.

The daemon checks the call's token again when a registration or a deletion commits, after
catching up with the store; a revocation committed in PostgreSQL between that catch-up and the
daemon's own transaction used to go unseen, and the registration committed. The store's own
functions now take the hash of the call's token and check it with the tenant's row locked,
inside the change. The window is reproduced deterministically at the database layer, with the
daemons' real login against a real PostgreSQL:

1. a token the store no longer lists is refused (registration and deletion), nothing is
   written, the revision does not move; a tenant's other, still valid token is accepted;
2. a revocation whose transaction is open when the registration starts (the registration
   waits for it: PostgreSQL says so in ``pg_stat_activity``) is seen when it commits;
3. ``evald store init`` upgrades a schema version 2 store: the functions without the token's
   hash, which a revoked token's registration gets through, are gone.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from daemon_harness import module
from fleet_harness import DAEMON_LOGIN, OPERATOR_LOGIN, Fleet, client, head, until
from psycopg import sql

from evald.contract import ErrorCode, EvaldError, token_sha256
from evald.daemon import store_database

#: The test cluster's superuser, the store's owner (as in fleet_harness).
OWNER = "evald_admin"
_NO_LONGER = "no longer names tenant 'team'"


def _as(fleet: Fleet, user: str, **options: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(fleet.url(user), password=fleet.server.logins[user], **options)


def _rows(fleet: Fleet) -> list[tuple[Any, ...]]:
    return fleet.server.execute(
        sql.SQL(
            "SELECT tenant, name, sha256, revision FROM evald.evaluators ORDER BY tenant, name"
        ),
        database=fleet.name,
    )


def _register(database: Any, wasm: bytes, name: str, token: str) -> int:
    return int(
        database.register(
            "team",
            name,
            name,
            hashlib.sha256(wasm).hexdigest(),
            wasm,
            {"name": name, "tag": name},
            replace=True,
            token_sha256=token_sha256(token),
        )
    )


def test_a_token_the_store_no_longer_lists_changes_nothing(fleet: Fleet) -> None:
    stolen = fleet.add_tenant("team")
    kept = f"team-second-token-{hashlib.sha256(stolen.encode()).hexdigest()[:16]}"
    fleet.operator.add_token("tests", "team", token_sha256(kept))
    (daemon,) = fleet.start(1)
    served = client(daemon, stolen).register(module("echo", "target"))
    pod = store_database(fleet.settings(DAEMON_LOGIN), application="tests-pod")
    try:
        # The daemon has checked the call's token; the operator revokes it before the write.
        revision, removed = fleet.operator.remove_tokens("tests", "team", [token_sha256(kept)])
        assert removed == 1
        before, rows = head(fleet), _rows(fleet)
        payload = module("output", "target", 2)
        with pytest.raises(EvaldError) as refused:
            _register(pod, payload, "target", stolen)
        assert refused.value.code is ErrorCode.PERMISSION_DENIED
        assert _NO_LONGER in refused.value.message
        with pytest.raises(EvaldError) as refused:
            pod.delete("team", "target", token_sha256=token_sha256(stolen))
        assert refused.value.code is ErrorCode.PERMISSION_DENIED
        assert _NO_LONGER in refused.value.message
        with pytest.raises(EvaldError) as refused:  # no token at all: never the tenant's
            pod.delete("team", "target", token_sha256=None)
        assert refused.value.code is ErrorCode.PERMISSION_DENIED
        assert (head(fleet), _rows(fleet)) == (before, rows) and before == revision
        assert rows == [("team", "target", served.sha256, rows[0][3])]
        # The tenant's other token still names it: the check is the token's, not the tenant's.
        assert _register(pod, payload, "target", kept) == before + 1
        assert pod.delete("team", "target", token_sha256=token_sha256(kept)) == before + 2
    finally:
        pod.close()


def test_a_revocation_committing_while_the_registration_waits_is_seen(fleet: Fleet) -> None:
    token = fleet.add_tenant("team")
    pod = store_database(fleet.settings(DAEMON_LOGIN), application="tests-racing-pod")
    outcome: list[BaseException | int] = []
    try:
        with _as(fleet, OPERATOR_LOGIN) as operator:
            # The operator's revocation, as `evald tenants revoke` writes it, not yet committed.
            operator.execute(b"SELECT evald.begin_change()")
            operator.execute(b"UPDATE evald.tenants SET token_sha256s = '{}' WHERE name = 'team'")
            operator.execute(
                b"SELECT evald.record_change('tests', 'tenant.revoke', 'team', NULL, NULL, NULL)"
            )
            before = head(fleet)

            def register() -> None:
                try:
                    outcome.append(_register(pod, module("echo", "late"), "late", token))
                except BaseException as exc:  # carried to the test's thread
                    outcome.append(exc)

            racer = threading.Thread(target=register, daemon=True)
            racer.start()
            until(
                lambda: (
                    fleet.server.execute(
                        sql.SQL(
                            "SELECT 1 FROM pg_stat_activity WHERE application_name ="
                            " 'tests-racing-pod' AND wait_event_type = 'Lock'"
                        ),
                        database=fleet.name,
                    )
                    != []
                ),
                "the registration waits for the open revocation",
            )
            operator.commit()
        racer.join(60)
        assert not racer.is_alive()
    finally:
        pod.close()
    (refused,) = outcome
    assert isinstance(refused, EvaldError), refused
    assert refused.code is ErrorCode.PERMISSION_DENIED and _NO_LONGER in refused.message
    assert head(fleet) == before + 1  # the revocation's revision; the registration's none
    assert _rows(fleet) == []


def test_store_init_drops_the_functions_without_the_tokens_hash(fleet: Fleet) -> None:
    token = fleet.add_tenant("team")
    fleet.operator.remove_tokens("tests", "team", None)
    owner_url = fleet.server.url(database=fleet.name)
    with psycopg.connect(owner_url, password=fleet.server.password, autocommit=True) as owner:
        owner.execute((Path(__file__).parent / "fleet_schema_v2_writes.sql").read_bytes())
    wasm = module("echo", "through")
    old_call = (
        "SELECT evald.register_evaluator(%s, %s, %s, %s, %s, %s, %s)",
        ("team", "through", "through", hashlib.sha256(wasm).hexdigest(), wasm, "{}", True),
    )
    with _as(fleet, DAEMON_LOGIN, autocommit=True) as conn:  # version 2: the revoked token's
        conn.execute(*old_call)  # registration is not refused
    assert [row[1] for row in _rows(fleet)] == ["through"]
    upgraded = fleet.cli("store", "init", user=OWNER)
    assert upgraded.returncode == 0, upgraded.stderr
    assert "upgraded from schema version 2" in upgraded.stdout, upgraded.stdout
    with _as(fleet, DAEMON_LOGIN, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.UndefinedFunction):
            conn.execute(*old_call)
        with pytest.raises(psycopg.errors.UndefinedFunction):
            conn.execute(b"SELECT evald.delete_evaluator('team', 'through')")
    signatures = fleet.server.execute(
        sql.SQL(
            "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n"
            " ON n.oid = p.pronamespace WHERE n.nspname = 'evald'"
            " AND p.proname IN ('register_evaluator', 'delete_evaluator') ORDER BY 1"
        ),
        database=fleet.name,
    )
    assert signatures == [
        ("evald.delete_evaluator(text,text,text)",),
        ("evald.register_evaluator(text,text,text,text,bytea,jsonb,boolean,text)",),
    ]
    pod = store_database(fleet.settings(DAEMON_LOGIN), application="tests-pod")
    try:
        with pytest.raises(EvaldError) as refused:
            pod.delete("team", "through", token_sha256=token_sha256(token))
        assert refused.value.code is ErrorCode.PERMISSION_DENIED
    finally:
        pod.close()
