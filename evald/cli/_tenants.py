"""Operator subcommands: ``tenants`` (add, rotate, revoke, limits, list), ``store`` (init, log)
and ``reload``.

``evald tenants`` and ``evald store`` talk to the fleet store (PostgreSQL) directly, with an
operator's database login (a role in ``evald_operator``): that login is the operator
credential, and no tenant token can stand in for it. Every daemon of the fleet applies a
change within a second or so, without a restart. With the embedded store the tenants are the
config's ``[[tenants]]``: ``list`` shows them, and a change is an edit of the file followed by
``evald reload`` (SIGHUP to the daemon that owns the state folder).

Where the store is: ``--store URL``, else ``$EVALD_STORE_URL``, else the ``[store] url`` of
``--config`` (or ``$EVALD_CONFIG``). The password: ``--password-file``, the config's
``password_file``/``password_env``, or libpq's ``PGPASSWORD``/``PGPASSFILE``; never on the
command line.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

from evald.cli import EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE, Runner, command

__all__: list[str] = []

_VERBS = ("add", "rotate", "revoke", "limits", "list")


def _fail(code: str, message: str, status: int = EXIT_ERROR) -> int:
    print(f"error: {code}: {message}", file=sys.stderr)
    return status


def _add_store_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("store")
    group.add_argument(
        "--store",
        metavar="URL",
        help="postgresql://USER@HOST[:PORT]/DB of the fleet store (default: $EVALD_STORE_URL, "
        "else the [store] url of --config)",
    )
    group.add_argument(
        "--config",
        metavar="FILE",
        help="a daemon config whose [store] to use (default: $EVALD_CONFIG, else the packaged "
        "default)",
    )
    group.add_argument(
        "--password-file",
        metavar="FILE",
        help="a file holding the store login's password (else the config's, or PGPASSWORD)",
    )


def _settings(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(store settings, config)`` from the options.

    Raises:
        ConfigError: the config cannot be read, or the URL carries a password.
    """
    from evald.daemon import StoreSettings, check_store_url, load_config

    config = load_config(args.config)
    url = args.store or os.environ.get("EVALD_STORE_URL", "").strip() or config.store.url
    same = url == config.store.url
    check_store_url(url, "--store")
    settings = StoreSettings(
        url=url,
        password_file=args.password_file or (config.store.password_file if same else ""),
        password_env="" if args.password_file or not same else config.store.password_env,
        connect_timeout_s=config.store.connect_timeout_s,
    )
    return settings, config


def _actor() -> str:
    return os.environ.get("SUDO_USER") or os.environ.get("USER") or "operator"


def _parse_limit(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    value: Any
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError(f"--limit {key.strip()}: the value is nested too deep") from None
    except ValueError:
        value = raw  # a size such as 64MiB
    return key.strip(), value


def _add_tenant_options(sub: argparse.ArgumentParser) -> None:
    """What ``tenants add`` and ``tenants limits`` set."""
    sub.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a [tenants.limits] key, for example deadline_ms=50 or memory_bytes=16MiB (repeat)",
    )
    sub.add_argument(
        "--evaluators",
        metavar="LIST",
        help='the standard evaluators it may call: "*" or calc,date,…',
    )
    sub.add_argument(
        "--may-register",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether it may register its own modules",
    )
    sub.add_argument("--max-modules", type=int, metavar="N", help="its module count cap")


@command("tenants", "Add, rotate, revoke, limit and list tenants (operators).", order=70)
def _tenants(parser: argparse.ArgumentParser) -> Runner:
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", title="verbs")
    add = verbs.add_parser("add", help="add a tenant; prints its first token once")
    add.add_argument("name", metavar="NAME")
    rotate = verbs.add_parser(
        "rotate", help="give a tenant a new token (prints it once); its others keep working"
    )
    rotate.add_argument("name", metavar="NAME")
    revoke = verbs.add_parser(
        "revoke", help="revoke tokens: open calls that use them end with unauthenticated"
    )
    revoke.add_argument("name", metavar="NAME")
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--token-sha256", metavar="HEX", help="the token with this hash")
    which.add_argument("--token", metavar="TOKEN", help="this token (hashed here)")
    which.add_argument("--old", action="store_true", help="every token but the newest")
    which.add_argument("--all", action="store_true", help="every token: the tenant is locked out")
    limits = verbs.add_parser("limits", help="change a tenant's limits and permissions")
    limits.add_argument("name", metavar="NAME")
    limits.add_argument(
        "--unset",
        action="append",
        default=[],
        metavar="KEY",
        help="back to the daemons' default for KEY",
    )
    listing = verbs.add_parser("list", help="the tenants, their tokens (hash prefixes), limits")
    listing.add_argument("--json", action="store_true", help="one JSON document")
    for sub in (add, limits):
        _add_tenant_options(sub)
    add.add_argument(
        "--token-sha256", metavar="HEX", help="use this token hash instead of making a token"
    )
    rotate.add_argument(
        "--token-sha256", metavar="HEX", help="add this token hash instead of making a token"
    )
    for sub in (add, rotate, revoke, limits, listing):
        _add_store_options(sub)

    def run(args: argparse.Namespace) -> int:
        from evald.contract import EvaldError
        from evald.daemon import ConfigError

        if args.verb not in _VERBS:
            parser.print_help(sys.stderr)
            return EXIT_ERROR
        try:
            settings, config = _settings(args)
        except ConfigError as exc:
            return _fail("invalid_argument", str(exc))
        if not settings.fleet:
            return _embedded(args, config)
        try:
            return _fleet(args, settings, config)
        except ConfigError as exc:
            return _fail("invalid_argument", str(exc))
        except EvaldError as exc:
            status = EXIT_UNREACHABLE if exc.code.value == "unavailable" else EXIT_ERROR
            return _fail(exc.code.value, exc.message, status)
        except ImportError as exc:
            return _fail("unavailable", f"the fleet store needs evald[postgres]: {exc}")

    return run


def _embedded(args: argparse.Namespace, config: Any) -> int:
    if args.verb != "list":
        return _fail(
            "invalid_argument",
            f"no fleet store is configured: the tenants are the [[tenants]] of {config.source}; "
            "edit it, then `evald reload` (or pass --store postgresql://…)",
        )
    rows = [
        {
            "name": tenant.name,
            "tokens": [h[:12] for h in tenant.token_sha256s],
            "evaluators": list(tenant.evaluators),
            "may_register": tenant.allow_register,
            "max_modules": tenant.max_modules,
            "source": config.source,
        }
        for tenant in config.tenants
    ]
    _print_rows(rows, args.json)
    return EXIT_OK


def _print_rows(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return
    for row in rows:
        tokens = ",".join(row["tokens"]) or "-"
        extra = f" limits {json.dumps(row['limits'])}" if row.get("limits") else ""
        modules = f" modules {row['modules']}" if "modules" in row else ""
        print(
            f"{row['name']}: tokens {tokens}; evaluators {','.join(row['evaluators']) or '-'}; "
            f"may_register {str(row['may_register']).lower()}; max_modules "
            f"{row['max_modules']}{modules}{extra}"
        )


def _new_token(args: argparse.Namespace) -> tuple[str | None, str]:
    from evald.daemon import hash_token

    given = getattr(args, "token_sha256", None)
    if given:
        digest = given.strip().lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError("--token-sha256: expected 64 hex digits")
        return None, digest
    token = secrets.token_urlsafe(32)
    return token, hash_token(token)


def _check_not_a_config_token(digest: str, config: Any) -> None:
    """Refuses a store token that a tenant of the config already holds: every daemon of that
    config would refuse the store tenant (and keep the token the config's)."""
    for tenant in config.tenants:
        if digest in tenant.token_sha256s:
            raise ValueError(
                f"--token-sha256: that token belongs to tenant {tenant.name!r} of the daemons' "
                f"config ({config.source}); a store tenant may not take it over"
            )


def _checked_limits(args: argparse.Namespace, base: dict[str, Any], config: Any) -> dict[str, Any]:
    from evald.daemon import parse_limits

    limits = dict(base)
    for text in args.limit:
        key, value = _parse_limit(text)
        limits[key] = value
    for key in args.unset if hasattr(args, "unset") else ():
        limits.pop(key, None)
    parse_limits(limits, config.default_limits, "--limit")  # unknown keys, bad values
    return limits


def _evaluator_list(text: str | None) -> list[str] | None:
    from evald.contract import STANDARD_EVALUATORS

    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name != "*" and name not in STANDARD_EVALUATORS:
            raise ValueError(
                f"--evaluators: {name!r} is not a standard evaluator "
                f'("*" or some of {", ".join(STANDARD_EVALUATORS)})'
            )
    return names


def _fleet(args: argparse.Namespace, settings: Any, config: Any) -> int:
    from evald.daemon import hash_token, is_tenant_name, store_database

    if args.verb != "list" and not is_tenant_name(args.name):
        return _fail("invalid_argument", "a tenant name matches [a-z][a-z0-9_-]{0,63}")
    database = store_database(settings, application="evald-tenants")
    try:
        actor = _actor()
        if args.verb == "list":
            rows = database.tenants()
            for row in rows:
                row["tokens"] = [h[:12] for h in row.pop("token_sha256s")]
            _print_rows(rows, args.json)
            return EXIT_OK
        try:
            if args.verb == "add":
                token, digest = _new_token(args)
                _check_not_a_config_token(digest, config)
                revision = database.add_tenant(
                    actor,
                    args.name,
                    [digest],
                    limits=_checked_limits(args, {}, config),
                    evaluators=_evaluator_list(args.evaluators) or [],
                    may_register=bool(args.may_register),
                    max_modules=16 if args.max_modules is None else args.max_modules,
                )
                _print_token(token, digest)
                print(f"added tenant {args.name} (revision {revision})")
            elif args.verb == "rotate":
                token, digest = _new_token(args)
                _check_not_a_config_token(digest, config)
                revision = database.add_token(actor, args.name, digest)
                _print_token(token, digest)
                print(
                    f"added a token to {args.name} (revision {revision}); revoke the old one "
                    f"once clients use the new one: evald tenants revoke {args.name} --old"
                )
            elif args.verb == "revoke":
                current = next(
                    (row for row in database.tenants() if row["name"] == args.name), None
                )
                hashes = list(current["token_sha256s"]) if current else []
                if args.all:
                    keep: list[str] | None = None
                elif args.old:
                    keep = hashes[-1:]
                else:
                    gone = args.token_sha256 or hash_token(args.token)
                    keep = [h for h in hashes if h != gone.strip().lower()]
                revision, removed = database.remove_tokens(actor, args.name, keep)
                print(f"revoked {removed} token(s) of {args.name} (revision {revision})")
            else:  # limits
                current = next(
                    (row for row in database.tenants() if row["name"] == args.name), None
                )
                limits = current["limits"] if current else {}
                base = dict(limits) if isinstance(limits, dict) else {}  # unreadable: replaced
                revision = database.update_tenant(
                    actor,
                    args.name,
                    limits=_checked_limits(args, base, config),
                    evaluators=_evaluator_list(args.evaluators),
                    may_register=args.may_register,
                    max_modules=args.max_modules,
                )
                print(f"changed tenant {args.name} (revision {revision})")
        except ValueError as exc:
            return _fail("invalid_argument", str(exc))
        return EXIT_OK
    finally:
        database.close()


def _print_token(token: str | None, digest: str) -> None:
    if token is not None:
        print(f"# the token (give it to the tenant; the store keeps only its hash):\n{token}")
    print(f"token_sha256 {digest}")


@command("store", "Set up the fleet store, or read its audit log (operators).", order=71)
def _store(parser: argparse.ArgumentParser) -> Runner:
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", title="verbs")
    init = verbs.add_parser(
        "init", help="create the schema and the evald_daemon / evald_operator roles (the owner)"
    )
    log = verbs.add_parser("log", help="who changed what, when (newest first)")
    log.add_argument("-n", type=int, default=20, metavar="N", help="how many changes (20)")
    log.add_argument("--json", action="store_true", help="one JSON document")
    for sub in (init, log):
        _add_store_options(sub)

    def run(args: argparse.Namespace) -> int:
        from evald.contract import EvaldError
        from evald.daemon import ConfigError, init_store, store_database

        if args.verb not in ("init", "log"):
            parser.print_help(sys.stderr)
            return EXIT_ERROR
        try:
            settings, _config = _settings(args)
            if not settings.fleet:
                return _fail("invalid_argument", "no fleet store: pass --store postgresql://…")
            if args.verb == "init":
                before = init_store(settings)
                upgraded = f"; upgraded from schema version {before}" if before else ""
                print(
                    "the fleet store is ready (schema evald, roles evald_daemon, evald_operator"
                    f"{upgraded})"
                )
                return EXIT_OK
            database = store_database(settings, application="evald-store")
            try:
                rows = database.audit(args.n)
            finally:
                database.close()
        except ConfigError as exc:
            return _fail("invalid_argument", str(exc))
        except EvaldError as exc:
            status = EXIT_UNREACHABLE if exc.code.value == "unavailable" else EXIT_ERROR
            return _fail(exc.code.value, exc.message, status)
        if args.json:
            print(json.dumps(rows, indent=2, default=str))
            return EXIT_OK
        for row in rows:
            what = " ".join(str(v) for v in (row["name"], (row["sha256"] or "")[:12]) if v)
            print(
                f"{row['revision']:>6}  {row['at']:%Y-%m-%d %H:%M:%S}  {row['role']}/"
                f"{row['actor']}  {row['action']}  {row['tenant']} {what}".rstrip()
            )
        return EXIT_OK

    return run


@command("reload", "Apply a changed config without a restart (SIGHUP to the daemon).", order=16)
def _reload(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        help="the daemon's state folder (default: the config's, else $XDG_STATE_HOME/evald)",
    )
    parser.add_argument(
        "--config", metavar="FILE", help="the daemon's config (for its state folder)"
    )

    def run(args: argparse.Namespace) -> int:
        from evald.daemon import ConfigError, load_config, running_daemon_pid

        try:
            config = load_config(args.config).with_overrides(state_dir=args.state_dir)
        except ConfigError as exc:
            return _fail("invalid_argument", str(exc))
        state_dir = Path(config.server.resolved_state_dir)
        pid = running_daemon_pid(state_dir)
        if pid is None:
            return _fail(
                "unavailable",
                f"no daemon holds the state folder {state_dir} (pass --state-dir)",
                EXIT_UNREACHABLE,
            )
        try:
            os.kill(pid, signal.SIGHUP)
        except OSError as exc:
            return _fail(
                "permission_denied", f"cannot signal the daemon (pid {pid}): {exc.strerror}"
            )
        print(
            f"asked the daemon (pid {pid}) to reload; it logs `config reloaded` "
            "(or `config not reloaded` and why)"
        )
        return EXIT_OK

    return run
