"""The fleet store in PostgreSQL: its schema, its roles, and every statement the daemons and the
operators run against it.

Why PostgreSQL and this shape: the fleet needs one durable source of truth that every daemon
follows, with changes in a total order. One row, ``evald.head``, holds the store's revision;
every change (a registration, a deletion, a tenant added, a token rotated or revoked, new
limits) is one transaction that first increments it (``UPDATE … RETURNING``: the row lock
serializes writers, so revisions commit in the order they are handed out and none is skipped),
stamps the rows it touches with it, appends one row to the audit log ``evald.changes`` (who,
what, when) and sends ``NOTIFY evald_changes`` (delivered at commit). A daemon reads what changed
since the revision it applied, in one ``REPEATABLE READ`` snapshot; the notification only tells
it when to look (:mod:`evald.daemon._fleet`).

Tables (schema ``evald``): ``head`` (the revision), ``tenants`` (name, token SHA-256s, limits
that differ from the daemons' defaults, allowed standard evaluators, may-register, max
modules), ``modules`` (bytes content-addressed by SHA-256), ``evaluators`` (a tenant's name ->
module hash, tag and manifest; a deleted one keeps its row with no hash, so a follower sees the
deletion) and ``changes``. Roles: ``evald_daemon`` reads everything it serves and may write only
registrations (``modules``, ``evaluators``), the audit log and the revision; ``evald_operator``
changes tenants. A login role joins one of them (docs/operations.md, "A fleet").

Every value is a query parameter: names, manifests and tokens that look like SQL are stored as
data. The password is passed apart from the URL and scrubbed from every message
(:func:`describe_error`), so it never reaches a log line, a metric or an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

import psycopg
import psycopg_pool
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from evald.contract import ErrorCode, EvaldError
from evald.daemon._config import StoreSettings

__all__ = [
    "CHANNEL",
    "DAEMON_ROLE",
    "OPERATOR_ROLE",
    "ChangeSet",
    "Database",
    "EvaluatorRow",
    "describe_error",
    "init_schema",
]

#: The ``LISTEN``/``NOTIFY`` channel; the payload is the new revision.
CHANNEL: Final = "evald_changes"
DAEMON_ROLE: Final = "evald_daemon"
OPERATOR_ROLE: Final = "evald_operator"

_SCHEMA: Final = """
CREATE SCHEMA IF NOT EXISTS evald;
CREATE TABLE IF NOT EXISTS evald.head (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    revision bigint NOT NULL CHECK (revision >= 0)
);
INSERT INTO evald.head (singleton, revision) VALUES (true, 0) ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS evald.tenants (
    name text PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9_-]{0,63}$'),
    token_sha256s text[] NOT NULL DEFAULT '{}',
    limits jsonb NOT NULL DEFAULT '{}',
    evaluators text[] NOT NULL DEFAULT '{}',
    may_register boolean NOT NULL DEFAULT false,
    max_modules integer NOT NULL DEFAULT 16 CHECK (max_modules >= 0),
    revision bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS evald.modules (
    sha256 text PRIMARY KEY CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    bytes bytea NOT NULL,
    size integer NOT NULL,
    stored_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS evald.evaluators (
    tenant text NOT NULL REFERENCES evald.tenants (name),
    name text NOT NULL,
    sha256 text REFERENCES evald.modules (sha256),
    tag text,
    manifest jsonb,
    revision bigint NOT NULL,
    PRIMARY KEY (tenant, name)
);
CREATE INDEX IF NOT EXISTS evaluators_by_revision ON evald.evaluators (revision);
CREATE INDEX IF NOT EXISTS tenants_by_revision ON evald.tenants (revision);
CREATE TABLE IF NOT EXISTS evald.changes (
    revision bigint PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    role text NOT NULL DEFAULT current_user,
    actor text NOT NULL,
    action text NOT NULL,
    tenant text NOT NULL,
    name text,
    sha256 text,
    detail jsonb NOT NULL DEFAULT '{}'
);
"""

# What each role may do, and nothing more (docs/operations.md, "A fleet": least privilege).
_GRANTS: Final = f"""
REVOKE ALL ON SCHEMA evald FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA evald FROM {DAEMON_ROLE}, {OPERATOR_ROLE};
GRANT USAGE ON SCHEMA evald TO {DAEMON_ROLE}, {OPERATOR_ROLE};
GRANT SELECT ON evald.head, evald.tenants, evald.modules, evald.evaluators, evald.changes
    TO {DAEMON_ROLE}, {OPERATOR_ROLE};
GRANT UPDATE (revision) ON evald.head TO {DAEMON_ROLE}, {OPERATOR_ROLE};
GRANT INSERT ON evald.changes TO {DAEMON_ROLE}, {OPERATOR_ROLE};
GRANT INSERT ON evald.modules TO {DAEMON_ROLE};
GRANT INSERT ON evald.evaluators TO {DAEMON_ROLE};
GRANT UPDATE (sha256, tag, manifest, revision) ON evald.evaluators TO {DAEMON_ROLE};
GRANT INSERT ON evald.tenants TO {OPERATOR_ROLE};
GRANT UPDATE (token_sha256s, limits, evaluators, may_register, max_modules, revision)
    ON evald.tenants TO {OPERATOR_ROLE};
"""


def describe_error(exc: BaseException, password: str | None = None) -> str:
    """A database error in one line an operator can act on, with the password scrubbed."""
    if isinstance(exc, psycopg_pool.PoolTimeout):
        text = "the fleet store did not answer in time (PostgreSQL down or unreachable)"
    else:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        text = lines[0] if lines else type(exc).__name__
    if password:
        text = text.replace(password, "***")
    return text[:300]


def _unavailable(exc: BaseException, password: str | None, doing: str) -> EvaldError:
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return EvaldError(
            ErrorCode.PERMISSION_DENIED,
            f"this store login may not {doing}: {describe_error(exc, password)} (tenants are "
            "changed with a login in evald_operator; daemons log in with one in evald_daemon)",
        )
    return EvaldError(
        ErrorCode.UNAVAILABLE,
        f"the fleet store could not {doing}: {describe_error(exc, password)}; nothing was "
        "changed, retry when it is back",
    )


@dataclass(frozen=True)
class EvaluatorRow:
    """One tenant's evaluator as the store holds it; ``sha256`` None: deleted."""

    tenant: str
    name: str
    sha256: str | None
    revision: int


@dataclass(frozen=True)
class ChangeSet:
    """What changed in the store after a revision, read in one snapshot.

    ``full`` is a complete copy (every tenant and every evaluator), read after a reconnect;
    otherwise only rows whose revision is past ``since``. ``revisions`` are the changes it
    carries, in order (the audit log's rows).
    """

    head: int
    since: int
    full: bool
    tenants: tuple[dict[str, Any], ...]
    evaluators: tuple[EvaluatorRow, ...]
    revisions: tuple[int, ...]


class Database:
    """One daemon's or operator's connections to the fleet store: a pool for statements, and a
    dedicated connection for ``LISTEN`` (:meth:`listen`). Thread-safe (the pool is)."""

    def __init__(self, settings: StoreSettings, *, application: str = "evald") -> None:
        self._settings = settings
        self._password = settings.password()
        self._kwargs: dict[str, Any] = {
            "connect_timeout": max(1, round(settings.connect_timeout_s)),
            "application_name": application,
        }
        if self._password is not None:
            self._kwargs["password"] = self._password
        self._pool = psycopg_pool.ConnectionPool(
            settings.url,
            kwargs=self._kwargs,
            min_size=1,
            max_size=2,
            open=False,
            check=psycopg_pool.ConnectionPool.check_connection,
            reconnect_timeout=0,  # never give up: the store comes back
            name="evald-store",
        )
        self._pool.open(wait=False)

    @property
    def password(self) -> str | None:
        return self._password

    def close(self) -> None:
        self._pool.close(timeout=1.0)

    @contextmanager
    def _connection(self, doing: str) -> Iterator[psycopg.Connection[Any]]:
        try:
            with self._pool.connection(timeout=self._settings.connect_timeout_s) as conn:
                yield conn
        except EvaldError:
            raise
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            raise _unavailable(exc, self._password, doing) from None

    def listen(self) -> psycopg.Connection[Any]:
        """A new autocommit connection that listens on :data:`CHANNEL`.

        Raises:
            EvaldError: ``unavailable`` when the store cannot be reached.
        """
        kwargs = {**self._kwargs, "application_name": f"{self._kwargs['application_name']}-listen"}
        try:
            conn = psycopg.connect(self._settings.url, autocommit=True, **kwargs)
            conn.execute(f"LISTEN {CHANNEL}")
        except psycopg.Error as exc:
            raise _unavailable(exc, self._password, "be reached") from None
        return conn

    # Reading ---------------------------------------------------------------------------------

    def changes(self, since: int, *, full: bool) -> ChangeSet:
        """What changed after ``since`` (everything when ``full``), in one consistent snapshot.

        Raises:
            EvaldError: ``unavailable``.
        """
        with self._connection("be read") as conn:
            with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                first = cur.execute("SELECT revision FROM evald.head").fetchone()
                assert first is not None, "evald.head has its one row (evald store init)"
                head = int(first["revision"])
                after = -1 if full else since
                tenants = cur.execute(
                    "SELECT name, token_sha256s, limits, evaluators, may_register,"
                    " max_modules, revision FROM evald.tenants WHERE revision > %s"
                    " ORDER BY revision, name",
                    (after,),
                ).fetchall()
                evaluators = cur.execute(
                    "SELECT tenant, name, sha256, revision FROM evald.evaluators"
                    " WHERE revision > %s ORDER BY revision, tenant, name",
                    (after,),
                ).fetchall()
                revisions = cur.execute(
                    "SELECT revision FROM evald.changes WHERE revision > %s"
                    " AND revision <= %s ORDER BY revision",
                    (since, head),
                ).fetchall()
        return ChangeSet(
            head=head,
            since=since,
            full=full,
            tenants=tuple(dict(row) for row in tenants),
            evaluators=tuple(
                EvaluatorRow(row["tenant"], row["name"], row["sha256"], int(row["revision"]))
                for row in evaluators
            ),
            revisions=tuple(int(row["revision"]) for row in revisions),
        )

    def module(self, sha256: str) -> bytes | None:
        """The bytes stored under ``sha256`` (not checked here: the caller checks the hash).

        Raises:
            EvaldError: ``unavailable``.
        """
        with self._connection("be read") as conn:
            row = conn.execute(
                "SELECT bytes FROM evald.modules WHERE sha256 = %s", (sha256,)
            ).fetchone()
        return None if row is None else bytes(row[0])

    def tenants(self) -> list[dict[str, Any]]:
        """Every tenant row with how many evaluators it has (``evald tenants list``)."""
        with self._connection("be read") as conn, conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(
                "SELECT t.name, t.token_sha256s, t.limits, t.evaluators, t.may_register,"
                " t.max_modules, t.revision,"
                " (SELECT count(*) FROM evald.evaluators e WHERE e.tenant = t.name"
                "  AND e.sha256 IS NOT NULL) AS modules"
                " FROM evald.tenants t ORDER BY t.name"
            ).fetchall()
        return [dict(row) for row in rows]

    def audit(self, limit: int) -> list[dict[str, Any]]:
        """The latest ``limit`` rows of the audit log, newest first."""
        with self._connection("be read") as conn, conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(
                "SELECT revision, at, role, actor, action, tenant, name, sha256, detail"
                " FROM evald.changes ORDER BY revision DESC LIMIT %s",
                (limit,),
            ).fetchall()
        return [dict(row) for row in rows]

    def head(self) -> int:
        with self._connection("be read") as conn:
            row = conn.execute("SELECT revision FROM evald.head").fetchone()
        return int(row[0]) if row else 0

    # Writing: one change per transaction -----------------------------------------------------

    @contextmanager
    def _change(self, doing: str) -> Iterator[tuple[psycopg.Cursor[Any], int]]:
        """One change: a transaction holding the next revision (the head row stays locked
        until commit, so revisions commit in order), notified at commit."""
        with self._connection(doing) as conn:
            try:
                with conn.transaction(), conn.cursor() as cur:
                    row = cur.execute(
                        "UPDATE evald.head SET revision = revision + 1 RETURNING revision"
                    ).fetchone()
                    assert row is not None, "evald.head has its one row (evald store init)"
                    revision = int(row[0])
                    yield cur, revision
                    cur.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(revision)))
            except EvaldError:
                raise
            except psycopg.Error as exc:
                raise _unavailable(exc, self._password, doing) from None

    @staticmethod
    def _audit(
        cur: psycopg.Cursor[Any],
        revision: int,
        *,
        actor: str,
        action: str,
        tenant: str,
        name: str | None = None,
        sha256: str | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> None:
        cur.execute(
            "INSERT INTO evald.changes (revision, actor, action, tenant, name, sha256, detail)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s)",
            (revision, actor, action, tenant, name, sha256, Jsonb(dict(detail or {}))),
        )

    def register(
        self,
        tenant: str,
        name: str,
        tag: str,
        sha256: str,
        wasm: bytes,
        manifest: Mapping[str, Any],
        *,
        replace: bool,
    ) -> int:
        """Stores one registration of ``tenant``'s and returns its revision. The rules are
        checked again inside the transaction, against the store (another daemon may have
        registered the same name a moment ago: one of the two wins).

        Raises:
            EvaldError: ``permission_denied`` (not a store tenant, or it may not register),
                ``invalid_argument`` (the name is taken and ``replace`` is off, a tag clash,
                ``max_modules``), ``unavailable`` (the store is unreachable: nothing stored).
        """
        with self._change("store the registration") as (cur, revision):
            row = cur.execute(
                "SELECT may_register, max_modules FROM evald.tenants WHERE name = %s",
                (tenant,),
            ).fetchone()
            if row is None or not row[0]:
                raise EvaldError(
                    ErrorCode.PERMISSION_DENIED,
                    f"tenant {tenant!r} may not register evaluators in the fleet store "
                    "(an operator runs `evald tenants limits " + tenant + " --may-register`)",
                )
            max_modules = int(row[1])
            others = cur.execute(
                "SELECT name, tag FROM evald.evaluators WHERE tenant = %s AND sha256 IS NOT NULL",
                (tenant,),
            ).fetchall()
            names = {other_name for other_name, _ in others}
            for other_name, other_tag in others:
                if other_name != name and (tag in (other_name, other_tag) or name == other_tag):
                    raise EvaldError(
                        ErrorCode.INVALID_ARGUMENT,
                        f"the manifest's name {name!r} or tag {tag!r} clashes with your "
                        f"evaluator {other_name!r} (tag {other_tag!r})",
                    )
            if name in names and not replace:
                raise EvaldError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"you already have an evaluator {name!r}; register with replace to update "
                    "it (`evald register --replace`)",
                )
            if name not in names and len(names) >= max_modules:
                raise EvaldError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"tenant {tenant!r} already has {len(names)} evaluators, its maximum (an "
                    "operator raises it with `evald tenants limits --max-modules`)",
                )
            cur.execute(
                "INSERT INTO evald.modules (sha256, bytes, size) VALUES (%s, %s, %s)"
                " ON CONFLICT (sha256) DO NOTHING",
                (sha256, wasm, len(wasm)),
            )
            cur.execute(
                "INSERT INTO evald.evaluators (tenant, name, sha256, tag, manifest, revision)"
                " VALUES (%s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (tenant, name) DO UPDATE SET sha256 = EXCLUDED.sha256,"
                " tag = EXCLUDED.tag, manifest = EXCLUDED.manifest, revision = EXCLUDED.revision",
                (tenant, name, sha256, tag, Jsonb(dict(manifest)), revision),
            )
            action = "evaluator.replace" if name in names else "evaluator.register"
            self._audit(
                cur,
                revision,
                actor=tenant,
                action=action,
                tenant=tenant,
                name=name,
                sha256=sha256,
                detail={"bytes": len(wasm)},
            )
        return revision

    def delete(self, tenant: str, name: str) -> int:
        """Deletes one of ``tenant``'s evaluators and returns the revision.

        Raises:
            EvaldError: ``unknown_evaluator`` (it has none by that name), ``unavailable``.
        """
        with self._change("store the deletion") as (cur, revision):
            row = cur.execute(
                "UPDATE evald.evaluators SET sha256 = NULL, tag = NULL, manifest = NULL,"
                " revision = %s WHERE tenant = %s AND name = %s AND sha256 IS NOT NULL"
                " RETURNING name",
                (revision, tenant, name),
            ).fetchone()
            if row is None:
                raise EvaldError(
                    ErrorCode.UNKNOWN_EVALUATOR,
                    f"tenant {tenant!r} has no registered evaluator {name!r}",
                )
            self._audit(
                cur, revision, actor=tenant, action="evaluator.delete", tenant=tenant, name=name
            )
        return revision

    # Operators' writes -----------------------------------------------------------------------

    def add_tenant(
        self,
        actor: str,
        name: str,
        token_sha256s: Sequence[str],
        *,
        limits: Mapping[str, Any],
        evaluators: Sequence[str],
        may_register: bool,
        max_modules: int,
    ) -> int:
        """Adds a tenant (``evald tenants add``); returns the revision.

        Raises:
            EvaldError: ``invalid_argument`` (the name or a token is taken), ``unavailable``.
        """
        with self._change("add the tenant") as (cur, revision):
            if cur.execute("SELECT 1 FROM evald.tenants WHERE name = %s", (name,)).fetchone():
                raise EvaldError(ErrorCode.INVALID_ARGUMENT, f"tenant {name!r} already exists")
            self._check_tokens_free(cur, token_sha256s)
            cur.execute(
                "INSERT INTO evald.tenants (name, token_sha256s, limits, evaluators,"
                " may_register, max_modules, revision) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (
                    name,
                    list(token_sha256s),
                    Jsonb(dict(limits)),
                    list(evaluators),
                    may_register,
                    max_modules,
                    revision,
                ),
            )
            self._audit(
                cur,
                revision,
                actor=actor,
                action="tenant.add",
                tenant=name,
                detail={"tokens": [h[:12] for h in token_sha256s], "limits": dict(limits)},
            )
        return revision

    @staticmethod
    def _check_tokens_free(cur: psycopg.Cursor[Any], token_sha256s: Sequence[str]) -> None:
        for token_sha256 in token_sha256s:
            taken = cur.execute(
                "SELECT name FROM evald.tenants WHERE %s = ANY (token_sha256s)", (token_sha256,)
            ).fetchone()
            if taken is not None:
                raise EvaldError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"token {token_sha256[:12]}… already belongs to tenant {taken[0]!r}",
                )

    def _locked_tenant(self, cur: psycopg.Cursor[Any], name: str) -> dict[str, Any]:
        row = cur.execute(
            "SELECT token_sha256s, limits, evaluators, may_register, max_modules"
            " FROM evald.tenants WHERE name = %s",
            (name,),
        ).fetchone()
        if row is None:
            raise EvaldError(
                ErrorCode.INVALID_ARGUMENT,
                f"no tenant {name!r} in the fleet store (`evald tenants list`)",
            )
        keys = ("token_sha256s", "limits", "evaluators", "may_register", "max_modules")
        return dict(zip(keys, row, strict=True))

    def add_token(self, actor: str, name: str, token_sha256: str) -> int:
        """Adds a token to a tenant, keeping its others (``evald tenants rotate``)."""
        with self._change("rotate the token") as (cur, revision):
            self._locked_tenant(cur, name)
            self._check_tokens_free(cur, (token_sha256,))
            cur.execute(
                "UPDATE evald.tenants SET token_sha256s = array_append(token_sha256s, %s),"
                " revision = %s WHERE name = %s",
                (token_sha256, revision, name),
            )
            self._audit(
                cur,
                revision,
                actor=actor,
                action="tenant.rotate",
                tenant=name,
                detail={"added": token_sha256[:12]},
            )
        return revision

    def remove_tokens(self, actor: str, name: str, keep: Sequence[str] | None) -> tuple[int, int]:
        """Keeps only the tokens in ``keep`` (None: none) of a tenant (``evald tenants
        revoke``); returns ``(revision, tokens removed)``."""
        with self._change("revoke the token") as (cur, revision):
            current = list(self._locked_tenant(cur, name)["token_sha256s"])
            kept = [h for h in current if keep is not None and h in keep]
            removed = [h for h in current if h not in kept]
            cur.execute(
                "UPDATE evald.tenants SET token_sha256s = %s, revision = %s WHERE name = %s",
                (kept, revision, name),
            )
            self._audit(
                cur,
                revision,
                actor=actor,
                action="tenant.revoke",
                tenant=name,
                detail={"removed": [h[:12] for h in removed], "left": len(kept)},
            )
        return revision, len(removed)

    def update_tenant(
        self,
        actor: str,
        name: str,
        *,
        limits: Mapping[str, Any] | None = None,
        evaluators: Sequence[str] | None = None,
        may_register: bool | None = None,
        max_modules: int | None = None,
    ) -> int:
        """Changes a tenant's limits (the full set of overrides), evaluators, may-register or
        max modules (``evald tenants limits``); returns the revision."""
        with self._change("change the tenant") as (cur, revision):
            current = self._locked_tenant(cur, name)
            new = {
                "limits": dict(current["limits"]) if limits is None else dict(limits),
                "evaluators": list(current["evaluators"] if evaluators is None else evaluators),
                "may_register": current["may_register"] if may_register is None else may_register,
                "max_modules": current["max_modules"] if max_modules is None else max_modules,
            }
            cur.execute(
                "UPDATE evald.tenants SET limits = %s, evaluators = %s, may_register = %s,"
                " max_modules = %s, revision = %s WHERE name = %s",
                (
                    Jsonb(new["limits"]),
                    new["evaluators"],
                    new["may_register"],
                    new["max_modules"],
                    revision,
                    name,
                ),
            )
            changed = {key: value for key, value in new.items() if value != current[key]}
            self._audit(
                cur,
                revision,
                actor=actor,
                action="tenant.limits",
                tenant=name,
                detail=json.loads(json.dumps(changed, default=str)),
            )
        return revision


def init_schema(settings: StoreSettings) -> None:
    """Creates the schema, the two group roles (when missing; a login role then joins one) and
    their grants. Run once, by the database's owner (``evald store init``); running it again
    changes nothing but the grants.

    Raises:
        EvaldError: ``unavailable`` (unreachable), ``permission_denied`` (the role may not
            create the schema or the roles).
    """
    password = settings.password()
    kwargs: dict[str, Any] = {"connect_timeout": max(1, round(settings.connect_timeout_s))}
    if password is not None:
        kwargs["password"] = password
    try:
        with psycopg.connect(settings.url, **kwargs) as conn, conn.transaction():
            for role in (DAEMON_ROLE, OPERATOR_ROLE):
                exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
                if exists.fetchone() is None:
                    conn.execute(f"CREATE ROLE {role} NOLOGIN")
            conn.execute(_SCHEMA)
            conn.execute(_GRANTS)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise EvaldError(
            ErrorCode.PERMISSION_DENIED,
            f"the store's owner must run this: {describe_error(exc, password)}",
        ) from None
    except psycopg.Error as exc:
        raise _unavailable(exc, password, "be set up") from None
