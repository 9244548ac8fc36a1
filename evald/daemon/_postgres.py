"""The fleet store in PostgreSQL: every statement the daemons and the operators run against it
(the schema, the roles and what each may do: :mod:`evald.daemon._store_schema`).

Why PostgreSQL and this shape: the fleet needs one durable source of truth that every daemon
follows, with changes in a total order. One row, ``evald.head``, holds the store's revision;
every change (a registration, a deletion, a tenant added, a token rotated or revoked, new
limits) is one transaction that first moves it forward by one (``evald.begin_change()``: the
row lock serializes writers, so revisions commit in the order they are handed out and none is
skipped), stamps the rows it touches with it, appends one row to the audit log
``evald.changes`` (who, what, when) and sends ``NOTIFY evald_changes`` (delivered at commit). A
daemon reads what changed since the revision it applied, in one ``REPEATABLE READ`` snapshot;
the notification only tells it when to look (:mod:`evald.daemon._fleet`).

A daemon writes only through ``evald.register_evaluator`` and ``evald.delete_evaluator``, which
check the tenant's rules, and that the call's token still names the tenant, inside the change;
an operator writes tenant rows and records the change with ``evald.record_change``. A tenant
row is read with its ``limits`` as text and decoded here, one row at a time: a row that does
not decode is that row's failure (:attr:`ChangeSet.refused`), never the whole read's.

Every value is a query parameter: names, manifests and tokens that look like SQL are stored as
data. The password is passed apart from the URL and scrubbed from every message
(:func:`describe_error`), so it never reaches a log line, a metric or an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg_pool
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from evald.contract import ErrorCode, EvaldError
from evald.daemon._config import StoreSettings
from evald.daemon._store_schema import CHANNEL, SQLSTATE_CODES, describe_error

__all__ = ["ChangeSet", "Database", "EvaluatorRow", "decode_tenant_row"]

_TENANT_COLUMNS = (
    "name, token_sha256s, limits::text AS limits, evaluators, may_register, max_modules, revision"
)


def _unavailable(exc: BaseException, password: str | None, doing: str) -> EvaldError:
    sqlstate = getattr(exc, "sqlstate", None)
    code = SQLSTATE_CODES.get(sqlstate or "")
    if code is not None:  # a rule the store's own functions checked
        diag = getattr(exc, "diag", None)
        message = getattr(diag, "message_primary", None) or describe_error(exc, password)
        return EvaldError(code, str(message)[:500])
    if isinstance(exc, psycopg.errors.UndefinedFunction):
        return EvaldError(
            ErrorCode.UNAVAILABLE,
            f"the fleet store's schema is older than this evald, so it could not {doing}: the "
            "store's owner runs `evald store init` once to upgrade it (nothing was changed)",
        )
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
    carries, in order (the audit log's rows). ``refused`` names the tenant rows that did not
    decode (name, why): each costs only its own tenant.
    """

    head: int
    since: int
    full: bool
    tenants: tuple[dict[str, Any], ...]
    evaluators: tuple[EvaluatorRow, ...]
    revisions: tuple[int, ...]
    refused: tuple[tuple[str, str], ...] = ()


def decode_tenant_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A tenant row read with ``limits`` as text, with its limits decoded.

    Raises:
        ValueError: the limits are not a JSON object this daemon can read (any failure of
            the decoder, a ``RecursionError`` on deep nesting included, is this row's).
    """
    document = dict(row)
    raw = document.get("limits")
    try:
        limits = json.loads(raw) if isinstance(raw, str) else raw
    except Exception as exc:  # RecursionError too: the row's failure, never the reader's
        raise ValueError(f"its limits do not decode: {type(exc).__name__}") from None
    if not isinstance(limits, dict):
        raise ValueError("its limits are not a JSON object")
    document["limits"] = limits
    return document


def _decoded(
    rows: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    good: list[dict[str, Any]] = []
    bad: list[tuple[str, str]] = []
    for row in rows:
        try:
            good.append(decode_tenant_row(row))
        except ValueError as exc:
            bad.append((str(row.get("name", "?"))[:64], str(exc)))
    return good, bad


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
                    f"SELECT {_TENANT_COLUMNS} FROM evald.tenants WHERE revision > %s"
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
        good, refused = _decoded(tenants)
        return ChangeSet(
            head=head,
            since=since,
            full=full,
            tenants=tuple(good),
            refused=tuple(refused),
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
                "SELECT t.name, t.token_sha256s, t.limits::text AS limits, t.evaluators,"
                " t.may_register,"
                " t.max_modules, t.revision,"
                " (SELECT count(*) FROM evald.evaluators e WHERE e.tenant = t.name"
                "  AND e.sha256 IS NOT NULL) AS modules"
                " FROM evald.tenants t ORDER BY t.name"
            ).fetchall()
        listed = []
        for row in rows:
            try:
                listed.append(decode_tenant_row(row))
            except ValueError as exc:
                listed.append({**row, "limits": f"unreadable: {exc}"})
        return listed

    def audit(self, limit: int) -> list[dict[str, Any]]:
        """The latest ``limit`` rows of the audit log, newest first."""
        with self._connection("be read") as conn, conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(
                "SELECT revision, at, role, actor, action, tenant, name, sha256,"
                " detail::text AS detail FROM evald.changes ORDER BY revision DESC LIMIT %s",
                (limit,),
            ).fetchall()
        return [{**row, "detail": _lenient_json(row["detail"])} for row in rows]

    def head(self) -> int:
        with self._connection("be read") as conn:
            row = conn.execute("SELECT revision FROM evald.head").fetchone()
        return int(row[0]) if row else 0

    # Writing: one change per transaction -----------------------------------------------------

    @contextmanager
    def _transaction(self, doing: str) -> Iterator[psycopg.Cursor[Any]]:
        """One transaction; a refusal of the store's own functions becomes its typed error."""
        with self._connection(doing) as conn:
            try:
                with conn.transaction(), conn.cursor() as cur:
                    yield cur
            except EvaldError:
                raise
            except psycopg.Error as exc:
                raise _unavailable(exc, self._password, doing) from None

    @contextmanager
    def _change(self, doing: str) -> Iterator[tuple[psycopg.Cursor[Any], int]]:
        """One operator's change: a transaction holding the next revision (the head row stays
        locked until commit, so revisions commit in order); :meth:`_audit` records it and
        notifies at commit."""
        with self._transaction(doing) as cur:
            row = cur.execute("SELECT evald.begin_change()").fetchone()
            assert row is not None, "evald.begin_change() returns the revision"
            yield cur, int(row[0])

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
        """The change's audit row (the store stamps its revision and the login's role)."""
        cur.execute(
            "SELECT evald.record_change(%s, %s, %s, %s, %s, %s)",
            (actor, action, tenant, name, sha256, Jsonb(dict(detail or {}))),
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
        token_sha256: str | None,
    ) -> int:
        """Stores one registration of ``tenant``'s and returns its revision. The store's
        ``evald.register_evaluator`` checks the rules again inside the change, against the
        store (another daemon may have registered the same name a moment ago: one of the two
        wins), and writes only ``tenant``'s row. ``token_sha256`` is the hash of the token the
        call used: the change commits only while it is still one of ``tenant``'s (checked with
        the tenant's row locked, so a revocation commits before the change or after it).

        Raises:
            EvaldError: ``permission_denied`` (not a store tenant, the token no longer names
                it, or it may not register),
                ``invalid_argument`` (the name is taken and ``replace`` is off, a tag clash,
                ``max_modules``), ``unavailable`` (the store is unreachable: nothing stored).
        """
        with self._transaction("store the registration") as cur:
            row = cur.execute(
                "SELECT evald.register_evaluator(%s, %s, %s, %s, %s, %s, %s, %s)",
                (tenant, name, tag, sha256, wasm, Jsonb(dict(manifest)), replace, token_sha256),
            ).fetchone()
        assert row is not None
        return int(row[0])

    def delete(self, tenant: str, name: str, *, token_sha256: str | None) -> int:
        """Deletes one of ``tenant``'s evaluators and returns the revision (``token_sha256``:
        as for :meth:`register`).

        Raises:
            EvaldError: ``permission_denied`` (the token no longer names ``tenant``),
                ``unknown_evaluator`` (it has none by that name), ``unavailable``.
        """
        with self._transaction("store the deletion") as cur:
            row = cur.execute(
                "SELECT evald.delete_evaluator(%s, %s, %s)", (tenant, name, token_sha256)
            ).fetchone()
        assert row is not None
        return int(row[0])

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
            "SELECT token_sha256s, limits::text, evaluators, may_register, max_modules"
            " FROM evald.tenants WHERE name = %s FOR UPDATE",
            (name,),
        ).fetchone()
        if row is None:
            raise EvaldError(
                ErrorCode.INVALID_ARGUMENT,
                f"no tenant {name!r} in the fleet store (`evald tenants list`)",
            )
        keys = ("token_sha256s", "limits", "evaluators", "may_register", "max_modules")
        document = dict(zip(keys, row, strict=True))
        try:
            return decode_tenant_row(document)
        except ValueError:
            document["limits"] = None  # unreadable: `evald tenants limits` may replace them
            return document

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
                "limits": _current_limits(name, current) if limits is None else dict(limits),
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


def _current_limits(name: str, current: Mapping[str, Any]) -> dict[str, Any]:
    limits = current["limits"]
    if limits is None:
        raise EvaldError(
            ErrorCode.INVALID_ARGUMENT,
            f"tenant {name!r}'s limits in the store are unreadable: set them whole with "
            "`evald tenants limits " + name + " --limit KEY=VALUE`",
        )
    return dict(limits)


def _lenient_json(text: Any) -> Any:
    """An audit row's detail, decoded when it can be (shown as text when it cannot)."""
    try:
        return json.loads(text) if isinstance(text, str) else text
    except Exception:  # RecursionError included: shown, never fatal
        return text[:200]
