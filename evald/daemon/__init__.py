"""The daemon: tenants and their limits, the module registry and store, the gRPC service, the
engine data path, metrics and the process lifecycle.

It serves the contract (``evald.contract``) and runs evaluations through the host
(``evald.host``); it knows nothing of engines or clients. Embed it with :class:`EvaldServer`,
or run it with :func:`serve` (what ``evald serve`` does). Its configuration is
:func:`load_config` / :func:`parse_config` (docs/daemon.md).
"""

from __future__ import annotations

from evald.daemon._admission import host_limits
from evald.daemon._config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    HostSettings,
    ServerSettings,
    TenantConfig,
    TenantLimits,
    default_state_dir,
    hash_token,
    load_config,
    parse_config,
)
from evald.daemon._gatekeeping import send_limit
from evald.daemon._parent_watch import (
    PARENT_FD_FLAG,
    ParentLink,
    set_parent_death_signal,
    watch_parent,
)
from evald.daemon._registry import STANDARD_OWNER, check_not_reserved
from evald.daemon._server import SERVICE_NAME, EvaldServer, host_config, serve

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "PARENT_FD_FLAG",
    "SERVICE_NAME",
    "STANDARD_OWNER",
    "Config",
    "ConfigError",
    "EvaldServer",
    "HostSettings",
    "ParentLink",
    "ServerSettings",
    "TenantConfig",
    "TenantLimits",
    "check_not_reserved",
    "default_state_dir",
    "hash_token",
    "host_config",
    "host_limits",
    "load_config",
    "parse_config",
    "send_limit",
    "serve",
    "set_parent_death_signal",
    "watch_parent",
]
