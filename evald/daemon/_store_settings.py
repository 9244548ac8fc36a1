"""The ``[store]`` table: where tenants and registered modules live (the embedded store, or the
fleet store in PostgreSQL), and how the store's password is found.

Why apart: the fleet store's settings are read by the daemon and by the operator's tools
(``evald tenants``, ``evald store``) alike, and a store URL is checked the same way wherever it
comes from (:func:`check_store_url`: the config, ``--store``, ``$EVALD_STORE_URL``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from evald.daemon._config_table import ConfigError, ConfigTable
from evald.daemon._operator_files import read_regular_file

__all__ = ["StoreSettings", "check_store_url", "store_from_table"]


@dataclass(frozen=True)
class StoreSettings:
    """The ``[store]`` table: where tenants and registered modules live.

    Empty ``url`` (the default) is the embedded store: tenants from this file, modules in the
    state folder, for one machine. A ``postgresql://`` URL is the fleet store shared by every
    daemon (docs/operations.md, "A fleet"): tenants, tokens, limits and modules in PostgreSQL,
    followed live; the state folder then holds the local cache that a restart serves while the
    store is down. The password is never part of the URL: ``password_file`` names a file that
    holds it, ``password_env`` an environment variable (libpq's own ``PGPASSWORD`` and
    ``PGPASSFILE`` work too). ``poll_s`` is how often a daemon checks the store's revision
    besides its notifications; ``connect_timeout_s`` bounds one attempt to reach it;
    ``max_stale_s`` is how long a daemon that cannot confirm it is current keeps serving the
    store's tenants (0: for ever; docs/operations.md, "A fleet", says why 300).
    """

    url: str = ""
    password_file: str = ""
    password_env: str = ""
    poll_s: float = 5.0
    connect_timeout_s: float = 3.0
    max_stale_s: float = 300.0

    @property
    def fleet(self) -> bool:
        """Whether the fleet store (PostgreSQL) is configured."""
        return bool(self.url)

    def password(self) -> str | None:
        """The store's password from ``password_file`` or ``password_env`` (None: libpq's own
        ways, or none).

        Raises:
            ConfigError: the file cannot be read, or the variable is not set.
        """
        if self.password_file:
            try:
                raw = read_regular_file(Path(self.password_file).expanduser())
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
                raise ConfigError(
                    f"store.password_file: cannot read {self.password_file}: {reason}"
                ) from None
            return text.strip("\r\n")
        if self.password_env:
            value = os.environ.get(self.password_env)
            if value is None:
                raise ConfigError(
                    f"store.password_env: the environment variable {self.password_env} is not set"
                )
            return value
        return None


def check_store_url(url: str, where: str = "store.url") -> None:
    """Refuses a store URL that is not ``postgresql://`` or that carries a password (the
    message never echoes the URL).

    Raises:
        ConfigError: saying what to change.
    """
    if not url:
        return
    scheme = url.partition("://")[0]
    if scheme not in ("postgresql", "postgres"):
        raise ConfigError(f"{where}: expected a postgresql:// URL (or nothing: the embedded store)")
    userinfo = url.partition("://")[2].partition("/")[0].partition("@")
    if (userinfo[1] and ":" in userinfo[0]) or "password=" in url.lower():
        raise ConfigError(
            f"{where}: the URL carries a password; put it in a file (store.password_file, "
            "--password-file) or the environment (store.password_env, PGPASSWORD) instead"
        )


def store_from_table(table: ConfigTable) -> StoreSettings:
    """The ``[store]`` table, each key checked.

    Raises:
        ConfigError: an unknown key, a bad value, or a URL that carries a password.
    """
    base = StoreSettings()
    url = table.get_str("url", base.url)
    try:
        check_store_url(url)
    except ConfigError as exc:
        raise ConfigError(f"{table.source}: {exc}") from None
    settings = StoreSettings(
        url=url,
        password_file=table.get_str("password_file", base.password_file),
        password_env=table.get_str("password_env", base.password_env),
        poll_s=table.get_float("poll_s", base.poll_s, minimum=0.1),
        connect_timeout_s=table.get_float("connect_timeout_s", base.connect_timeout_s, minimum=0.1),
        max_stale_s=table.get_float("max_stale_s", base.max_stale_s, minimum=0.0),
    )
    if (settings.password_file or settings.password_env) and not url:
        raise table.error("password_file", "a password needs store.url (the fleet store)")
    table.finish()
    return settings
