"""The fleet store's schema, its roles and what each role may do, in PostgreSQL itself.

Why the database enforces it: every inference pod holds the daemons' login (``evald_daemon``),
so whatever that login can do, a compromised pod can do. The rules that keep the control plane
whole therefore live in the database, as PostgreSQL's role model intends, not in the daemon:

* the revision (``evald.head``) moves forward by exactly one per change (a trigger refuses any
  other update, whoever makes it), and no role updates it directly: a change starts in
  :func:`begin_change` (``SECURITY DEFINER``), so it cannot be set to 0 or to 2^63-1;
* a daemon writes only through two functions, ``evald.register_evaluator`` and
  ``evald.delete_evaluator``: they check the tenant's rules (the call's token still one of the
  tenant's, may register, ``max_modules``, name and tag clashes, the bytes' hash) inside the
  change, with the tenant's row locked (a revocation commits before the change, which is then
  refused, or after it: never unseen in between), write only that tenant's row, and
  record which tenant uploaded which module (``evald.uploads``; an evaluator's module must be
  one its own tenant uploaded: a foreign key). The login has no INSERT, UPDATE or DELETE on any
  table;
* an audit row (``evald.changes``) is written only through those functions or
  ``evald.record_change`` (operators), only for the change its transaction opened, and a
  trigger stamps its ``role`` with ``session_user``: the login that really made it;
* ``evald store init`` takes PUBLIC's ``CONNECT`` and ``TEMPORARY`` on the database away (any
  login of the cluster could otherwise connect and flood ``NOTIFY evald_changes``); the two
  group roles get ``CONNECT`` back.

``evald store init`` is re-runnable: every statement is idempotent, and it upgrades a store of
an older :data:`SCHEMA_VERSION` in place (docs/operations.md, "A fleet": upgrading).
"""

from __future__ import annotations

from typing import Any, Final

import psycopg
from psycopg import sql

from evald.contract import ErrorCode, EvaldError
from evald.daemon._config import StoreSettings

__all__ = [
    "CHANNEL",
    "DAEMON_ROLE",
    "OPERATOR_ROLE",
    "SCHEMA_VERSION",
    "SQLSTATE_CODES",
    "init_schema",
]

#: The ``LISTEN``/``NOTIFY`` channel. Daemons ignore payloads: a notification only says "look".
CHANNEL: Final = "evald_changes"
DAEMON_ROLE: Final = "evald_daemon"
OPERATOR_ROLE: Final = "evald_operator"
#: 1: tables and direct grants; 2: writes only through functions, the head trigger, uploads;
#: 3: the daemons' two functions take the call's token hash and check it in the change.
SCHEMA_VERSION: Final = 3
#: The SQLSTATEs the store's functions raise, and the error each one is to a caller.
SQLSTATE_CODES: Final = {
    "EV400": ErrorCode.INVALID_ARGUMENT,
    "EV403": ErrorCode.PERMISSION_DENIED,
    "EV404": ErrorCode.UNKNOWN_EVALUATOR,
    "EV409": ErrorCode.INVALID_ARGUMENT,
}

_TABLES: Final = """
CREATE SCHEMA IF NOT EXISTS evald;
CREATE TABLE IF NOT EXISTS evald.head (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    revision bigint NOT NULL CHECK (revision >= 0)
);
INSERT INTO evald.head (singleton, revision) VALUES (true, 0) ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS evald.schema (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    version integer NOT NULL
);
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
    role text NOT NULL DEFAULT session_user,
    actor text NOT NULL,
    action text NOT NULL,
    tenant text NOT NULL,
    name text,
    sha256 text,
    detail jsonb NOT NULL DEFAULT '{}'
);
ALTER TABLE evald.changes ALTER COLUMN role SET DEFAULT session_user;
-- Which tenant uploaded which module: an evaluator's module is one its own tenant uploaded.
CREATE TABLE IF NOT EXISTS evald.uploads (
    tenant text NOT NULL REFERENCES evald.tenants (name),
    sha256 text NOT NULL REFERENCES evald.modules (sha256),
    PRIMARY KEY (tenant, sha256)
);
INSERT INTO evald.uploads (tenant, sha256)
    SELECT DISTINCT tenant, sha256 FROM evald.evaluators WHERE sha256 IS NOT NULL
    ON CONFLICT DO NOTHING;
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'evaluators_module_uploaded'
                   AND conrelid = 'evald.evaluators'::regclass) THEN
        ALTER TABLE evald.evaluators ADD CONSTRAINT evaluators_module_uploaded
            FOREIGN KEY (tenant, sha256) REFERENCES evald.uploads (tenant, sha256);
    END IF;
END $$;
"""

# The change machinery: a change is open in the transaction that moved the head.
_CHANGES: Final = """
CREATE OR REPLACE FUNCTION evald.this_change() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_revision bigint;
    v_xmin text;
BEGIN
    SELECT revision, xmin::text INTO v_revision, v_xmin FROM evald.head;
    IF v_xmin IS DISTINCT FROM (pg_current_xact_id()::text::numeric % 4294967296)::text THEN
        RAISE EXCEPTION 'no change is open in this transaction (a change starts with '
            'evald.begin_change())' USING ERRCODE = 'EV409';
    END IF;
    RETURN v_revision;
END $$;

CREATE OR REPLACE FUNCTION evald.head_moves_forward() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.revision IS DISTINCT FROM OLD.revision + 1 OR NOT NEW.singleton THEN
        RAISE EXCEPTION 'evald.head moves forward by one per change: % to % refused',
            OLD.revision, NEW.revision USING ERRCODE = 'EV409';
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS head_moves_forward ON evald.head;
CREATE TRIGGER head_moves_forward BEFORE UPDATE ON evald.head
    FOR EACH ROW EXECUTE FUNCTION evald.head_moves_forward();

CREATE OR REPLACE FUNCTION evald.stamp_revision() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.revision := evald.this_change();
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS stamp_revision ON evald.tenants;
CREATE TRIGGER stamp_revision BEFORE INSERT OR UPDATE ON evald.tenants
    FOR EACH ROW EXECUTE FUNCTION evald.stamp_revision();
DROP TRIGGER IF EXISTS stamp_revision ON evald.evaluators;
CREATE TRIGGER stamp_revision BEFORE INSERT OR UPDATE ON evald.evaluators
    FOR EACH ROW EXECUTE FUNCTION evald.stamp_revision();

CREATE OR REPLACE FUNCTION evald.stamp_change() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.revision := evald.this_change();
    NEW.role := session_user;
    NEW.at := now();
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS stamp_change ON evald.changes;
CREATE TRIGGER stamp_change BEFORE INSERT ON evald.changes
    FOR EACH ROW EXECUTE FUNCTION evald.stamp_change();

CREATE OR REPLACE FUNCTION evald.begin_change() RETURNS bigint
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE evald.head SET revision = revision + 1 RETURNING revision
$$;

CREATE OR REPLACE FUNCTION evald.record_change(
    p_actor text, p_action text, p_tenant text, p_name text, p_sha256 text, p_detail jsonb
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_revision bigint := evald.this_change();
BEGIN
    INSERT INTO evald.changes (revision, actor, action, tenant, name, sha256, detail)
        VALUES (v_revision, p_actor, p_action, p_tenant, p_name, p_sha256,
                coalesce(p_detail, '{}'));
    PERFORM pg_notify('evald_changes', '');
    RETURN v_revision;
END $$;
"""

# What a daemon may write: one tenant's registration or deletion, under the tenant's rules,
# while the call's token still names the tenant. The signatures of schema version 2 (without
# the token's hash) are dropped, so no login keeps a way around the check.
_DAEMON_WRITES: Final = """
DROP FUNCTION IF EXISTS evald.register_evaluator(text, text, text, text, bytea, jsonb, boolean);
DROP FUNCTION IF EXISTS evald.delete_evaluator(text, text);

-- The tenant's row, locked FOR SHARE until the change commits, when p_token_sha256 (the hash
-- of the token the call used) is still one of its tokens: a revocation (which locks the row
-- FOR UPDATE) commits before this check, and the change is refused, or after the change.
CREATE OR REPLACE FUNCTION evald.token_names_tenant(p_tenant text, p_token_sha256 text)
RETURNS evald.tenants
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_tenant evald.tenants;
BEGIN
    SELECT * INTO v_tenant FROM evald.tenants WHERE name = p_tenant FOR SHARE;
    IF NOT FOUND OR p_token_sha256 IS NULL
       OR NOT (p_token_sha256 = ANY (v_tenant.token_sha256s)) THEN
        RAISE EXCEPTION 'the token this call was made with no longer names tenant % (it was '
            'revoked in the fleet store while the call waited); nothing was changed',
            quote_literal(p_tenant) USING ERRCODE = 'EV403';
    END IF;
    RETURN v_tenant;
END $$;

CREATE OR REPLACE FUNCTION evald.register_evaluator(
    p_tenant text, p_name text, p_tag text, p_sha256 text, p_bytes bytea, p_manifest jsonb,
    p_replace boolean, p_token_sha256 text
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_revision bigint := evald.begin_change();
    v_tenant evald.tenants := evald.token_names_tenant(p_tenant, p_token_sha256);
    v_clash record;
    v_exists boolean;
    v_count integer;
BEGIN
    IF NOT v_tenant.may_register THEN
        RAISE EXCEPTION 'tenant % may not register evaluators in the fleet store (an operator '
            'runs `evald tenants limits % --may-register`)', quote_literal(p_tenant), p_tenant
            USING ERRCODE = 'EV403';
    END IF;
    IF encode(sha256(p_bytes), 'hex') IS DISTINCT FROM p_sha256 THEN
        RAISE EXCEPTION 'the module''s bytes do not match its hash %', left(p_sha256, 12)
            USING ERRCODE = 'EV400';
    END IF;
    SELECT name, tag INTO v_clash FROM evald.evaluators
        WHERE tenant = p_tenant AND sha256 IS NOT NULL AND name <> p_name
          AND (p_tag IN (name, tag) OR p_name = tag)
        LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'the manifest''s name % or tag % clashes with your evaluator % (tag %)',
            quote_literal(p_name), quote_literal(p_tag), quote_literal(v_clash.name),
            quote_literal(v_clash.tag) USING ERRCODE = 'EV400';
    END IF;
    SELECT count(*) FILTER (WHERE name = p_name) > 0, count(*) INTO v_exists, v_count
        FROM evald.evaluators WHERE tenant = p_tenant AND sha256 IS NOT NULL;
    IF v_exists AND NOT p_replace THEN
        RAISE EXCEPTION 'you already have an evaluator %; register with replace to update it '
            '(`evald register --replace`)', quote_literal(p_name) USING ERRCODE = 'EV400';
    END IF;
    IF NOT v_exists AND v_count >= v_tenant.max_modules THEN
        RAISE EXCEPTION 'tenant % already has % evaluators, its maximum (an operator raises it '
            'with `evald tenants limits --max-modules`)', quote_literal(p_tenant), v_count
            USING ERRCODE = 'EV400';
    END IF;
    INSERT INTO evald.modules (sha256, bytes, size) VALUES (p_sha256, p_bytes, length(p_bytes))
        ON CONFLICT (sha256) DO NOTHING;
    INSERT INTO evald.uploads (tenant, sha256) VALUES (p_tenant, p_sha256) ON CONFLICT DO NOTHING;
    INSERT INTO evald.evaluators (tenant, name, sha256, tag, manifest, revision)
        VALUES (p_tenant, p_name, p_sha256, p_tag, p_manifest, v_revision)
        ON CONFLICT (tenant, name) DO UPDATE SET sha256 = EXCLUDED.sha256,
            tag = EXCLUDED.tag, manifest = EXCLUDED.manifest;
    PERFORM evald.record_change(p_tenant,
        CASE WHEN v_exists THEN 'evaluator.replace' ELSE 'evaluator.register' END,
        p_tenant, p_name, p_sha256, jsonb_build_object('bytes', length(p_bytes)));
    RETURN v_revision;
END $$;

CREATE OR REPLACE FUNCTION evald.delete_evaluator(
    p_tenant text, p_name text, p_token_sha256 text
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_revision bigint := evald.begin_change();
    v_tenant evald.tenants := evald.token_names_tenant(p_tenant, p_token_sha256);
BEGIN
    UPDATE evald.evaluators SET sha256 = NULL, tag = NULL, manifest = NULL
        WHERE tenant = p_tenant AND name = p_name AND sha256 IS NOT NULL;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'tenant % has no registered evaluator %', quote_literal(p_tenant),
            quote_literal(p_name) USING ERRCODE = 'EV404';
    END IF;
    PERFORM evald.record_change(p_tenant, 'evaluator.delete', p_tenant, p_name, NULL, NULL);
    RETURN v_revision;
END $$;
"""

# What each role may do, and nothing more (docs/operations.md, "A fleet": least privilege).
_GRANTS: Final = f"""
REVOKE ALL ON SCHEMA evald FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA evald FROM PUBLIC, {DAEMON_ROLE}, {OPERATOR_ROLE};
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA evald FROM PUBLIC, {DAEMON_ROLE}, {OPERATOR_ROLE};
GRANT USAGE ON SCHEMA evald TO {DAEMON_ROLE}, {OPERATOR_ROLE};
GRANT SELECT ON evald.head, evald.schema, evald.tenants, evald.modules, evald.evaluators,
    evald.changes, evald.uploads TO {DAEMON_ROLE}, {OPERATOR_ROLE};
GRANT EXECUTE ON FUNCTION evald.this_change() TO {DAEMON_ROLE}, {OPERATOR_ROLE};
GRANT EXECUTE ON FUNCTION
    evald.register_evaluator(text, text, text, text, bytea, jsonb, boolean, text),
    evald.delete_evaluator(text, text, text) TO {DAEMON_ROLE};
GRANT EXECUTE ON FUNCTION evald.begin_change(),
    evald.record_change(text, text, text, text, text, jsonb) TO {OPERATOR_ROLE};
GRANT INSERT ON evald.tenants TO {OPERATOR_ROLE};
GRANT UPDATE (token_sha256s, limits, evaluators, may_register, max_modules, revision)
    ON evald.tenants TO {OPERATOR_ROLE};
INSERT INTO evald.schema (singleton, version) VALUES (true, {SCHEMA_VERSION})
    ON CONFLICT (singleton) DO UPDATE SET version = EXCLUDED.version;
"""


def describe_error(exc: BaseException, password: str | None = None) -> str:
    """A database error in one line an operator can act on, with the password scrubbed."""
    import psycopg_pool

    if isinstance(exc, psycopg_pool.PoolTimeout):
        text = "the fleet store did not answer in time (PostgreSQL down or unreachable)"
    else:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        text = lines[0] if lines else type(exc).__name__
    if password:
        text = text.replace(password, "***")
    return text[:300]


def _database_grants(conn: psycopg.Connection[Any]) -> None:
    """No login connects to the store's database (or makes temporary tables there) unless it
    is in one of the two roles."""
    row = conn.execute("SELECT current_database()").fetchone()
    assert row is not None
    database = sql.Identifier(str(row[0]))
    conn.execute(sql.SQL("REVOKE CONNECT, TEMPORARY ON DATABASE {} FROM PUBLIC").format(database))
    conn.execute(
        sql.SQL("GRANT CONNECT ON DATABASE {} TO {}, {}").format(
            database, sql.Identifier(DAEMON_ROLE), sql.Identifier(OPERATOR_ROLE)
        )
    )


def init_schema(settings: StoreSettings) -> int:
    """Creates or upgrades the schema, the two group roles (when missing; a login role then
    joins one), their grants and the database's own. Run by the database's owner (``evald
    store init``); running it again changes nothing but an older schema, which it upgrades
    in place. Returns the schema version it upgraded from (0: it was new, or current).

    Raises:
        EvaldError: ``unavailable`` (unreachable), ``permission_denied`` (the role may not
            create the schema or the roles, or does not own the database).
    """
    password = settings.password()
    kwargs: dict[str, Any] = {"connect_timeout": max(1, round(settings.connect_timeout_s))}
    if password is not None:
        kwargs["password"] = password
    try:
        with psycopg.connect(settings.url, **kwargs) as conn, conn.transaction():
            # One init at a time: two owners running it at once would race on the DDL.
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('evald store init'))")
            for role in (DAEMON_ROLE, OPERATOR_ROLE):
                exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
                if exists.fetchone() is None:
                    conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(role)))
            found = conn.execute("SELECT to_regclass('evald.schema') IS NOT NULL").fetchone()
            had_tables = conn.execute("SELECT to_regclass('evald.head') IS NOT NULL").fetchone()
            before = 0
            if found and found[0]:
                version = conn.execute("SELECT version FROM evald.schema").fetchone()
                before = int(version[0]) if version else 1
            elif had_tables and had_tables[0]:
                before = 1
            conn.execute(_TABLES)
            conn.execute(_CHANGES)
            conn.execute(_DAEMON_WRITES)
            conn.execute(_GRANTS)
            _database_grants(conn)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise EvaldError(
            ErrorCode.PERMISSION_DENIED,
            f"the store's owner must run this: {describe_error(exc, password)}",
        ) from None
    except psycopg.Error as exc:
        retry = ", retry when it is back" if isinstance(exc, psycopg.OperationalError) else ""
        raise EvaldError(
            ErrorCode.UNAVAILABLE,
            f"the fleet store could not be set up: {describe_error(exc, password)}; nothing "
            f"was changed{retry}",
        ) from None
    return before if 0 < before < SCHEMA_VERSION else 0
