"""The registry of a fleet daemon: what it serves follows the fleet store, and a registration
is a change in the store.

Why a registry of its own: a registration or a deletion is a transaction in the store (where
the rules are checked again, by the store's own functions, so of two daemons registering one
name at once one wins, and a token revoked in the store since the daemon last caught up is
refused there), served here once committed; what a tenant's evaluators are is the
store's, applied by the follower (:mod:`evald.daemon._fleet`); and a store tenant's call is
refused ``unavailable`` while the daemon's knowledge of the store is older than
``[store] max_stale_s`` (:mod:`evald.daemon._fleet_status`), checked here because every
evaluation, on either transport, resolves its evaluator here first.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from time import monotonic
from typing import Any

from evald.contract import ErrorCode, EvaldError
from evald.daemon._background_loads import StillLoading
from evald.daemon._config import TenantConfig
from evald.daemon._fleet_status import FleetStatus
from evald.daemon._postgres import Database
from evald.daemon._registry import Evaluator, Registry, check_not_reserved
from evald.daemon._state_files import StateFileError
from evald.daemon._store import ModuleStore
from evald.host import CompiledModule, LoadedModule, WasmHost, peek_manifest_section

__all__ = ["FleetRegistry"]

_log = logging.getLogger("evald.store")


class FleetRegistry(Registry):
    """The registry of a fleet daemon: what it serves follows the store; a registration or a
    deletion is a transaction in the store (where the rules are checked again, so of two
    daemons registering one name at once one wins), served here once committed."""

    def __init__(
        self,
        host: WasmHost,
        cache: ModuleStore,
        tenants: Iterable[TenantConfig],
        *,
        compile: Callable[[bytes, int], CompiledModule],
        database: Database,
        committed: Callable[[], None],
        status: FleetStatus,
    ) -> None:
        super().__init__(host, cache, tenants, compile=compile)
        self._database = database
        self._committed = committed
        self._status = status
        self.compile_upload = compile

    def resolve(self, tenant: str, name_or_tag: str) -> Evaluator:
        """As the registry's, but a store tenant is refused while the store is stale.

        Raises:
            EvaldError: ``unavailable`` (stale: the message says so), or the registry's.
        """
        if monotonic() > self._status.fresh_until:  # the one cost on the evaluation path
            config = self._tenants.get(tenant)
            refusal = self._status.stale()
            if refusal is not None and config is not None and config.source == "store":
                raise EvaldError(ErrorCode.UNAVAILABLE, refusal)
        return Registry.resolve(self, tenant, name_or_tag)

    def commit_upload(
        self,
        tenant: TenantConfig,
        wasm: bytes,
        module: LoadedModule,
        replace: bool,
        *,
        token_sha256: str | None = None,
    ) -> Evaluator:
        evaluator = super().commit_upload(tenant, wasm, module, replace, token_sha256=token_sha256)
        self._committed()  # catch up to the revision that carries it (and any before it)
        return evaluator

    def _check_not_loading(self, tenant: str) -> None:
        """The store checks the rules against every module of the tenant: nothing to wait for."""

    def delete(
        self, tenant: TenantConfig, name: str, *, token_sha256: str | None = None
    ) -> Evaluator:
        evaluator = super().delete(tenant, name, token_sha256=token_sha256)
        self._committed()
        return evaluator

    def _persist(
        self,
        tenant: TenantConfig,
        name: str,
        wasm: bytes,
        replace: bool,
        *,
        token_sha256: str | None,
    ) -> None:
        if tenant.source != "store":
            raise EvaldError(
                ErrorCode.PERMISSION_DENIED,
                f"tenant {tenant.name!r} is defined in this daemon's config, not in the fleet "
                "store: register with a fleet tenant's token (`evald tenants add`)",
            )
        payload = peek_manifest_section(wasm)
        manifest: Any = json.loads(payload) if payload is not None else {}
        self._database.register(
            tenant.name,
            name,
            str(manifest.get("tag", "")),
            hashlib.sha256(wasm).hexdigest(),
            wasm,
            manifest,
            replace=replace,
            token_sha256=token_sha256,
        )
        try:
            self._store.put_module(wasm)  # the local cache: a restart without the store
        except StateFileError as exc:
            _log.warning("module not cached locally", extra={"fields": {"error": exc.message}})

    def _persist_delete(self, tenant: TenantConfig, name: str, *, token_sha256: str | None) -> None:
        if tenant.source != "store":
            raise EvaldError(
                ErrorCode.PERMISSION_DENIED,
                f"tenant {tenant.name!r} is defined in this daemon's config, not in the "
                "fleet store",
            )
        self._database.delete(tenant.name, name, token_sha256=token_sha256)

    def _changed(self) -> None:
        """The revision is the store's: the follower sets it when it applies one."""

    def apply_evaluators(
        self,
        wanted: dict[str, dict[str, str]],
        tenants: Iterable[str],
        load: Callable[[TenantConfig, str, str], Evaluator],
    ) -> None:
        """Serves, for each of ``tenants``, exactly the evaluators ``wanted`` names (name ->
        module hash): one whose hash is already served is kept as it is, a new or changed one is
        loaded with ``load`` (one that does not load is not served; ``load`` logs it; one still
        loading keeps the module served before, if any), one no longer wanted stops being
        served."""
        with self._write_lock:
            for tenant in tenants:
                config = self._tenants.get(tenant)
                if config is None or config.source != "store":
                    continue
                current = self._owned.get(tenant, {})
                owned: dict[str, Evaluator] = {}
                for name, sha256 in sorted(wanted.get(tenant, {}).items()):
                    served = current.get(name)
                    if served is not None and served.module.sha256 == sha256:
                        owned[name] = served
                        continue
                    try:
                        owned[name] = load(config, name, sha256)
                    except StillLoading:
                        if served is not None:
                            owned[name] = served
                    except EvaldError:
                        continue
                self._owned[tenant] = owned
                for name, served in current.items():
                    if owned.get(name) is not served and not self.serves(served.module.sha256):
                        self._host.forget(served.module)
                    if name not in owned and self.on_removed is not None:
                        self.on_removed(tenant, name)
            self._rebuild()

    def owners(self) -> list[str]:
        """Tenants that have modules served now."""
        return [tenant for tenant, owned in self._owned.items() if owned]

    def check_loaded(self, tenant: TenantConfig, name: str, evaluator: Evaluator) -> None:
        """The rules a module from the store is held to here too: its name is not reserved and
        its manifest names it.

        Raises:
            EvaldError: ``invalid_argument`` naming the rule.
        """
        check_not_reserved(name, evaluator.tag, self._reserved)
        if evaluator.module.manifest.name != name:
            raise EvaldError(
                ErrorCode.INVALID_ARGUMENT,
                f"the store names the module {evaluator.module.sha256[:12]} {name!r}, but its "
                f"manifest names it {evaluator.module.manifest.name!r}",
            )
