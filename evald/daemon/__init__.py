"""The daemon: tenants and their limits, the module registry and store, the gRPC service, the
engine data path, metrics and the process lifecycle.

It serves the contract (``evald.contract``) and runs evaluations through the host
(``evald.host``); it knows nothing of engines or clients. Embed it with :class:`EvaldServer`,
or run it with :func:`serve` (what ``evald serve`` does). Its configuration is
:func:`load_config` / :func:`parse_config` (docs/daemon.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from evald.daemon._admission import host_limits
from evald.daemon._child_start import ChildStart, child_start
from evald.daemon._config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    HostSettings,
    ServerSettings,
    StoreSettings,
    TenantConfig,
    TenantLimits,
    check_store_url,
    default_state_dir,
    hash_token,
    is_tenant_name,
    load_config,
    parse_config,
    parse_limits,
)
from evald.daemon._cpu_affinity import format_cpu_list, parse_cpu_list
from evald.daemon._gatekeeping import send_limit
from evald.daemon._parent_watch import PARENT_FD_FLAG, ParentLink, watch_parent
from evald.daemon._registry import STANDARD_OWNER, check_not_reserved
from evald.daemon._server import (
    SERVICE_NAME,
    STORE_HEALTH_SERVICE,
    EvaldServer,
    host_config,
    serve,
)
from evald.daemon._store import running_daemon_pid

if TYPE_CHECKING:
    from evald.daemon._postgres import Database


def store_database(settings: StoreSettings, *, application: str = "evald") -> Database:
    """The fleet store's connections for an operator's tool (``evald tenants``, ``evald store
    log``, the control-plane benchmark). Needs ``evald[postgres]``; imported only here, so the
    embedded store never needs psycopg."""
    from evald.daemon._postgres import Database

    return Database(settings, application=application)


def init_store(settings: StoreSettings) -> int:
    """Creates or upgrades the fleet store's schema, roles and grants (``evald store init``);
    returns the schema version it upgraded from (0: it was new, or current)."""
    from evald.daemon._store_schema import init_schema

    return init_schema(settings)


__all__ = [
    "DEFAULT_CONFIG_PATH",
    "PARENT_FD_FLAG",
    "SERVICE_NAME",
    "STANDARD_OWNER",
    "STORE_HEALTH_SERVICE",
    "ChildStart",
    "Config",
    "ConfigError",
    "EvaldServer",
    "HostSettings",
    "ParentLink",
    "ServerSettings",
    "StoreSettings",
    "TenantConfig",
    "TenantLimits",
    "check_not_reserved",
    "check_store_url",
    "child_start",
    "default_state_dir",
    "format_cpu_list",
    "hash_token",
    "host_config",
    "host_limits",
    "init_store",
    "is_tenant_name",
    "load_config",
    "parse_config",
    "parse_cpu_list",
    "parse_limits",
    "running_daemon_pid",
    "send_limit",
    "serve",
    "store_database",
    "watch_parent",
]
