"""The daemon's configuration: one typed place, loaded from TOML, with errors that name the bad key.

Everything the daemon does differently per deployment is read here: where it listens, where it
keeps registered modules, the host's engine-wide settings, the default limits and the tenants. A
config file names only what it changes; every key has a default that works out of the box
(``evald/daemon/default_config.toml`` ships with the package and is used when no file is given).

This module is the whole config (:class:`Config`, :func:`parse_config`, :func:`load_config`);
each of its parts has a module named after it, whose names are importable from here too:

* :mod:`~evald.daemon._config_table`: reading a TOML table (types, ranges, sizes such as
  ``"64MiB"``, unknown keys) and :class:`ConfigError`;
* :mod:`~evald.daemon._server_settings`: ``[server]``;
* :mod:`~evald.daemon._host_settings`: ``[host]``;
* :mod:`~evald.daemon._store_settings`: ``[store]``;
* :mod:`~evald.daemon._tenant_config`: ``[defaults.limits]``, each ``[[tenants]]`` and a fleet
  store's tenant rows.

Tokens are never stored: a tenant carries the hex SHA-256 of its token (:func:`hash_token`,
``evald hash-token``). The config file is read only if it is a regular file
(:mod:`~evald.daemon._operator_files`): a FIFO in its place is refused, never waited on.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from evald.contract import default_target as default_target
from evald.contract import token_sha256
from evald.daemon._config_table import GIB as GIB
from evald.daemon._config_table import KIB as KIB
from evald.daemon._config_table import MIB as MIB
from evald.daemon._config_table import ConfigError, ConfigTable, parse_size
from evald.daemon._host_settings import HostSettings, host_from_table
from evald.daemon._operator_files import read_regular_file
from evald.daemon._server_settings import ServerSettings, default_state_dir, server_from_table
from evald.daemon._store_settings import StoreSettings, check_store_url, store_from_table
from evald.daemon._tenant_config import (
    TenantConfig,
    TenantLimits,
    is_tenant_name,
    limits_from_table,
    parse_limits,
    tenant_from_store,
    tenant_from_table,
)

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_CONFIG_PATH",
    "Config",
    "ConfigError",
    "HostSettings",
    "ServerSettings",
    "StoreSettings",
    "TenantConfig",
    "TenantLimits",
    "check_store_url",
    "default_state_dir",
    "hash_token",
    "is_tenant_name",
    "load_config",
    "parse_config",
    "parse_limits",
    "parse_size",
    "tenant_from_store",
]

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent / "default_config.toml"
#: The config file ``evald serve`` (and every ``load_config()``) reads when none is named.
CONFIG_ENV: Final = "EVALD_CONFIG"


def hash_token(token: str) -> str:
    """The hex SHA-256 a tenant's ``token_sha256`` holds for ``token``
    (:func:`evald.contract.token_sha256`, the one home of a token's hash)."""
    return token_sha256(token)


@dataclass(frozen=True)
class Config:
    """The whole configuration. ``source`` names the file it came from (for messages, and the
    file a live reload reads again)."""

    server: ServerSettings = field(default_factory=ServerSettings)
    host: HostSettings = field(default_factory=HostSettings)
    default_limits: TenantLimits = field(default_factory=TenantLimits)
    tenants: tuple[TenantConfig, ...] = ()
    source: str = "<defaults>"
    store: StoreSettings = field(default_factory=StoreSettings)

    def tenant(self, name: str) -> TenantConfig | None:
        """The tenant called ``name``, if any."""
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        return None

    def with_overrides(
        self,
        *,
        listen: str | None = None,
        state_dir: str | None = None,
        cpus: frozenset[int] | None = None,
    ) -> Config:
        """A copy with command-line overrides applied (``evald serve --listen/--state-dir/
        --cpus``)."""
        server = self.server
        if listen:
            server = replace(server, listen=listen)
        if state_dir:
            server = replace(server, state_dir=state_dir)
        if cpus:
            server = replace(server, cpus=cpus)
        return replace(self, server=server)


def parse_config(text: str, source: str = "<string>") -> Config:
    """Parses and validates a config.

    Raises:
        ConfigError: invalid TOML, an unknown key, a value of the wrong type or range, or an
            inconsistent set of tenants. The message names the file and the key.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    root = ConfigTable(data, "", source)
    server = server_from_table(root.get_table("server"))
    host = host_from_table(root.get_table("host"))
    store = store_from_table(root.get_table("store"))
    defaults = root.get_table("defaults")
    default_limits = limits_from_table(defaults.get_table("limits"), TenantLimits())
    defaults.finish()
    tenant_tables = root.get_tables("tenants")
    root.finish()
    tenants = tuple(tenant_from_table(table, default_limits) for table in tenant_tables)
    _check_tenants(tenants, source)
    return Config(
        server=server,
        host=host,
        default_limits=default_limits,
        tenants=tenants,
        source=source,
        store=store,
    )


def _check_tenants(tenants: tuple[TenantConfig, ...], source: str) -> None:
    """What only the tenants together can break: a name or a token given twice, two tenants
    without a token (the unix socket's tenant is one)."""
    names: set[str] = set()
    hashes: set[str] = set()
    tokenless = [tenant.name for tenant in tenants if tenant.tokenless]
    for index, tenant in enumerate(tenants):
        if tenant.name in names:
            raise ConfigError(f"{source}: tenants[{index}].name: duplicate tenant {tenant.name!r}")
        names.add(tenant.name)
        for digest in tenant.token_sha256s:
            if digest in hashes:
                raise ConfigError(
                    f"{source}: tenants[{index}].token_sha256: "
                    "the same token is given to two tenants"
                )
            hashes.add(digest)
    if len(tokenless) > 1:
        raise ConfigError(
            f"{source}: tenants: at most one tenant may have no token_sha256 (the unix-socket "
            f"tenant); found {', '.join(tokenless)}"
        )


def load_config(path: Path | str | None = None) -> Config:
    """Loads ``path``, or ``$EVALD_CONFIG``, or the packaged default config.

    Only a regular file is read (links followed): a FIFO, a device or a folder is refused at
    once, so a reload never waits on what the path names.

    Raises:
        ConfigError: the file cannot be read, is not a regular file, or is invalid.
    """
    if path is None:
        env = os.environ.get(CONFIG_ENV, "").strip()
        path = Path(env) if env else DEFAULT_CONFIG_PATH
    path = Path(path)
    try:
        text = read_regular_file(path).decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: the config is not UTF-8 text") from None
    return parse_config(text, str(path))
