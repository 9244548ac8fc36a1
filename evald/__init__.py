"""evald: a gRPC daemon that runs evaluators compiled to WebAssembly under limits.

The public API, re-exported from the private modules that implement it:

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
    from evald._client import CallError, Client
    from evald._config import (
        Config,
        ConfigError,
        HostSettings,
        ServerSettings,
        TenantConfig,
        TenantLimits,
        default_target,
        hash_token,
        load_config,
        parse_config,
    )
    from evald._data_client import DataCallError, DataConnection
    from evald._errors import ERROR_CODE_METADATA_KEY, ErrorCode, EvaldError
    from evald._host import EvalOutcome, HostConfig, Limits, LoadedModule, Manifest, WasmHost
    from evald._server import EvaldServer, serve

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
    "CallError": "_client",
    "Client": "_client",
    "Config": "_config",
    "ConfigError": "_config",
    "HostSettings": "_config",
    "ServerSettings": "_config",
    "TenantConfig": "_config",
    "TenantLimits": "_config",
    "default_target": "_config",
    "hash_token": "_config",
    "load_config": "_config",
    "parse_config": "_config",
    "DataCallError": "_data_client",
    "DataConnection": "_data_client",
    "ERROR_CODE_METADATA_KEY": "_errors",
    "ErrorCode": "_errors",
    "EvaldError": "_errors",
    "EvalOutcome": "_host",
    "HostConfig": "_host",
    "Limits": "_host",
    "LoadedModule": "_host",
    "Manifest": "_host",
    "WasmHost": "_host",
    "EvaldServer": "_server",
    "serve": "_server",
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
