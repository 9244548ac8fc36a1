"""evald: a gRPC daemon that runs evaluators compiled to WebAssembly under limits.

The public API, re-exported from the subpackages that implement it (``evald.contract``,
``evald.client``, ``evald.daemon``, ``evald.host``, ``evald.sdk``; docs/design.md, "Layout"):

* the daemon: :func:`serve` (blocking, until SIGTERM/SIGINT) and :class:`EvaldServer` (to embed
  it in an event loop);
* its configuration: :func:`load_config`, :func:`parse_config`, :class:`Config` and the typed
  sections, :func:`hash_token`, :func:`default_target`;
* a blocking client: :class:`Client`, :class:`CallError`;
* the engine data path's client end (docs/data-path.md): :class:`DataConnection`,
  :class:`DataCallError`;
* the stable error codes: :class:`ErrorCode`, :class:`EvaldError`;
* the wasm host: :class:`WasmHost`, :class:`HostConfig`, :class:`Limits`, :class:`LoadedModule`,
  :class:`EvalOutcome`, :class:`Manifest`.

Names are imported on first use, so ``import evald`` (and every ``evald`` command) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from evald.client import CallError, Client, DataCallError, DataConnection
    from evald.contract import (
        ERROR_CODE_METADATA_KEY,
        ErrorCode,
        EvaldError,
        Manifest,
        default_target,
    )
    from evald.daemon import (
        Config,
        ConfigError,
        EvaldServer,
        HostSettings,
        ServerSettings,
        TenantConfig,
        TenantLimits,
        hash_token,
        load_config,
        parse_config,
        serve,
    )
    from evald.host import EvalOutcome, HostConfig, Limits, LoadedModule, WasmHost

__all__ = [
    "ERROR_CODE_METADATA_KEY",
    "CallError",
    "Client",
    "Config",
    "ConfigError",
    "DataCallError",
    "DataConnection",
    "ErrorCode",
    "EvalOutcome",
    "EvaldError",
    "EvaldServer",
    "HostConfig",
    "HostSettings",
    "Limits",
    "LoadedModule",
    "Manifest",
    "ServerSettings",
    "TenantConfig",
    "TenantLimits",
    "WasmHost",
    "default_target",
    "hash_token",
    "load_config",
    "parse_config",
    "serve",
]

_HOMES = {
    "CallError": "client",
    "Client": "client",
    "Config": "daemon",
    "ConfigError": "daemon",
    "HostSettings": "daemon",
    "ServerSettings": "daemon",
    "TenantConfig": "daemon",
    "TenantLimits": "daemon",
    "default_target": "contract",
    "hash_token": "daemon",
    "load_config": "daemon",
    "parse_config": "daemon",
    "DataCallError": "client",
    "DataConnection": "client",
    "ERROR_CODE_METADATA_KEY": "contract",
    "ErrorCode": "contract",
    "EvaldError": "contract",
    "EvalOutcome": "host",
    "HostConfig": "host",
    "Limits": "host",
    "LoadedModule": "host",
    "Manifest": "contract",
    "WasmHost": "host",
    "EvaldServer": "daemon",
    "serve": "daemon",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'evald' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"evald.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
