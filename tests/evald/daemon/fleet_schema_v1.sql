-- The fleet store as the first release's `evald store init` (schema version 1) made it:
-- tables, and direct grants to the two roles. test_fleet_hardening upgrades it in place.
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
REVOKE ALL ON SCHEMA evald FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA evald FROM evald_daemon, evald_operator;
GRANT USAGE ON SCHEMA evald TO evald_daemon, evald_operator;
GRANT SELECT ON evald.head, evald.tenants, evald.modules, evald.evaluators, evald.changes
    TO evald_daemon, evald_operator;
GRANT UPDATE (revision) ON evald.head TO evald_daemon, evald_operator;
GRANT INSERT ON evald.changes TO evald_daemon, evald_operator;
GRANT INSERT ON evald.modules TO evald_daemon;
GRANT INSERT ON evald.evaluators TO evald_daemon;
GRANT UPDATE (sha256, tag, manifest, revision) ON evald.evaluators TO evald_daemon;
GRANT INSERT ON evald.tenants TO evald_operator;
GRANT UPDATE (token_sha256s, limits, evaluators, may_register, max_modules, revision)
    ON evald.tenants TO evald_operator;
