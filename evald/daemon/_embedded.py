"""The embedded store: tenants from this daemon's TOML config, modules in its state folder.

The default, for one machine: nothing to run beside the daemon. A live reload (``SIGHUP``, or
``evald reload``) reads the config file again and applies its tenants (added, removed, new
tokens, new limits) without dropping calls; every other table needs a restart, and a config
that does not parse changes nothing (the error is logged). The daemon's revision (reported by
``ListEvaluators``) grows with every registration, deletion and reload, and is kept in the state
folder's ``revision`` file, so it never goes back across restarts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

from evald.daemon._config import Config
from evald.daemon._control_store import StoreDaemon
from evald.daemon._indexed_registry import IndexedRegistry
from evald.daemon._state_files import StateFileError, atomic_write, read_bytes
from evald.daemon._store import ModuleStore
from evald.host import CompiledModule, WasmHost

__all__ = ["EmbeddedStore"]

_log = logging.getLogger("evald.store")
_REVISION_FILE: Final = "revision"


class EmbeddedStore:
    """Tenants from the config, modules in the state folder (see the module)."""

    kind: Final = "embedded"

    def __init__(self, config: Config, daemon: StoreDaemon, store: ModuleStore) -> None:
        self._config = config
        self._daemon = daemon
        self._store = store
        self._registry: IndexedRegistry | None = None
        self.problem: str | None = None

    def make_registry(
        self, host: WasmHost, compile: Callable[[bytes, int], CompiledModule]
    ) -> IndexedRegistry:
        registry = IndexedRegistry(host, self._store, self._config.tenants, compile=compile)
        registry.revision = self._read_revision()
        registry.on_change = self._write_revision
        self._registry = registry
        return registry

    def load(self) -> dict[str, int]:
        """Starts loading the state folder's modules (off the control thread); returns at
        once with the index entries of each tenant being loaded."""
        registry = self._registry
        assert registry is not None, "make_registry() has not run"
        limits = {
            tenant.name: self._daemon.limits_of(tenant.name) for tenant in self._config.tenants
        }
        return registry.load_registered(limits)

    def reload(self, config: Config) -> None:
        """Applies the tenants of ``config`` (the file read again)."""
        registry = self._registry
        assert registry is not None, "make_registry() has not run"
        self._daemon.apply_tenants(config.tenants)
        with registry._write_lock:
            registry._changed()

    def catch_up(self) -> None:
        """Nothing to catch up with: every change is this daemon's own."""

    def close(self) -> None:
        """Nothing to close: the state folder's lock is the daemon's."""

    def _read_revision(self) -> int:
        try:
            text = read_bytes(self._store.state_dir / _REVISION_FILE, 32).decode("ascii")
            return max(0, int(text.strip()))
        except StateFileError as exc:
            if not exc.missing:
                _log.warning("revision file refused", extra={"fields": {"error": exc.message}})
        except (UnicodeDecodeError, ValueError):
            _log.warning("revision file refused", extra={"fields": {"error": "not a number"}})
        return 0

    def _write_revision(self, revision: int) -> None:
        try:
            atomic_write(self._store.state_dir / _REVISION_FILE, f"{revision}\n".encode())
        except StateFileError as exc:
            _log.warning("revision not kept", extra={"fields": {"error": exc.message}})
