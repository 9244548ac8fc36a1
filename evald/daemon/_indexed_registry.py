"""The embedded store's registry: tenants' modules in the state folder, one index per tenant.

At start (:meth:`IndexedRegistry.load_registered`) and when a reload adds a tenant, each
tenant's index is read at once but its modules are loaded off the control thread (loading may
compile) and served by a job on it (:attr:`~evald.daemon._registry.Registry.schedule`): the
daemon serves, and applies tenants and tokens, before any module is loaded; until a tenant's
are served, what it asks for that is not served yet is answered ``unavailable`` (retry).
Every entry is then held to the rules of registration. Registrations and deletions are written
to the module files and the index before they are served.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from evald.contract import ErrorCode, EvaldError
from evald.daemon._config import TenantConfig
from evald.daemon._registry import Evaluator, Registry, check_not_reserved, shown
from evald.daemon._store import IndexEntry, StoreError
from evald.host import Limits, LoadedModule

__all__ = ["IndexedRegistry"]

_log = logging.getLogger("evald.registry")


class IndexedRegistry(Registry):
    """The registry of the embedded store (see the module)."""

    def load_registered(self, limits_for: dict[str, Limits]) -> dict[str, int]:
        """Starts loading every module tenants registered before the last stop (see
        :meth:`_begin_load`); returns at once. Indexes of tenants that are no longer configured
        are kept on disk and not served. Unreferenced module files are removed.

        Returns:
            Index entries being loaded, per tenant.
        """
        counts: dict[str, int] = {}
        referenced: set[str] = set()
        with self._write_lock:
            for tenant in self._store.tenant_names():
                index = self._read_index(tenant, referenced)
                if index is None:
                    continue
                if tenant not in self._tenants:
                    _log.warning(
                        "registered modules of a tenant not in the config are not served",
                        extra={"fields": {"tenant": tenant, "modules": len(index)}},
                    )
                    continue
                counts[tenant] = len(index)
                self._index[tenant] = index
            self._rebuild()
        removed = self._store.collect_garbage(referenced)
        # Compiled code of modules nobody refers to any more (refused or deleted before a
        # crash, or compiled by an older wasmtime).
        standard = {evaluator.module.sha256 for evaluator in self._standard.values()}
        removed += self._host.collect_cache(referenced | standard)
        if removed:
            _log.info("removed unreferenced files", extra={"fields": {"files": removed}})
        for tenant in counts:
            self._begin_load(tenant, self._index[tenant], limits_for[tenant])
        return counts

    def _begin_load(self, tenant: str, index: dict[str, IndexEntry], limits: Limits) -> None:
        """Loads ``tenant``'s ``index`` off the control thread (:attr:`schedule`) and serves it
        once loaded (:meth:`_serve_loaded`); until then the tenant is *loading*."""
        if not index:
            return
        self.loading(tenant, +1)
        config = self._tenants[tenant]

        def load() -> dict[str, LoadedModule | EvaldError]:
            return self._read_modules(config, index, limits)

        def apply(loaded: dict[str, LoadedModule | EvaldError]) -> None:
            self._serve_loaded(tenant, index, loaded)

        if self.schedule is None:
            apply(load())
        else:
            self.schedule(load, apply)

    def _read_modules(
        self, tenant: TenantConfig, index: dict[str, IndexEntry], limits: Limits
    ) -> dict[str, LoadedModule | EvaldError]:
        """Reads and loads an index's entries until ``max_modules`` of them load (the module
        thread: loading may compile); a module that does not load is its error."""
        loaded: dict[str, LoadedModule | EvaldError] = {}
        served = 0
        for entry in index.values():
            if served >= tenant.max_modules:
                break
            try:
                check_not_reserved(entry.name, entry.name, self._reserved)
                loaded[entry.name] = self._host.load(
                    self._store.read_module(entry.sha256), limits=limits
                )
                served += 1
            except EvaldError as exc:
                loaded[entry.name] = exc
        return loaded

    def _serve_loaded(
        self,
        tenant: str,
        index: dict[str, IndexEntry],
        loaded: dict[str, LoadedModule | EvaldError],
    ) -> None:
        """Serves a tenant's loaded index (the control thread), each entry held to the rules
        of registration (:meth:`_load_entry`). An entry that breaks one, or whose module did not
        load (corrupt file, a limit lowered since), is logged, not served and left in the index,
        so fixing the config or the index brings it back; the tenant's other modules are served.
        Nothing is served when the tenant's index changed meanwhile (it was removed)."""
        with self._write_lock:
            self.loading(tenant, -1)
            if tenant in self._tenants and self._index.get(tenant) is index:
                served = self._serve_index(tenant, index, loaded)
                self._changed()  # what the tenant may call changed: listings key on it
                _log.info(
                    "registered modules loaded",
                    extra={"fields": {"tenant": tenant, "served": served}},
                )
            self._rebuild()

    def _read_index(self, tenant: str, referenced: set[str]) -> dict[str, IndexEntry] | None:
        """A tenant's index, its hashes added to ``referenced``; None (logged once) when it
        cannot be read: then every module file counts as referenced (the index may be repaired
        by hand) and the tenant's index is never overwritten."""
        try:
            index = self._store.read_index(tenant)
        except StoreError as exc:
            _log.error("tenant index unreadable", extra={"fields": {"error": exc.message}})
            referenced.update(path.stem for path in self._store.modules_dir.glob("*.wasm"))
            self._unreadable.add(tenant)
            return None
        referenced.update(entry.sha256 for entry in index.values())
        return index

    def _serve_index(
        self,
        tenant: str,
        index: dict[str, IndexEntry],
        loaded: dict[str, LoadedModule | EvaldError],
    ) -> int:
        """Serves one tenant's loaded index (caller holds the lock); returns how many of its
        entries are served."""
        owned: dict[str, Evaluator] = {}
        config = self._tenants[tenant]
        past_cap = 0
        for entry in index.values():
            if len(owned) >= config.max_modules:
                past_cap += 1  # not loaded at all: one line says how many
                continue
            try:
                module = loaded.get(entry.name)
                if module is None:
                    past_cap += 1
                    continue
                owned[entry.name] = self._load_entry(config, owned, entry, module)
            except EvaldError as exc:
                _log.error(
                    "registered module not served",
                    extra={
                        "fields": {
                            "tenant": tenant,
                            "evaluator": shown(entry.name),
                            "error": exc.message[:300],
                        }
                    },
                )
        if past_cap:
            _log.error(
                "registered modules not served: past max_modules",
                extra={
                    "fields": {
                        "tenant": tenant,
                        "entries": past_cap,
                        "max_modules": config.max_modules,
                    }
                },
            )
        self._owned[tenant] = owned
        return len(owned)

    def set_tenants(self, tenants: Iterable[TenantConfig], limits_for: dict[str, Limits]) -> None:
        """Serves ``tenants`` from now on (a live reload): a new tenant's modules are loaded
        from its index, a removed tenant's are no longer served (its index is kept), a changed
        tenant's config (evaluators, may-register, max modules) applies at once. A new tenant's
        modules load off the control thread (:meth:`_begin_load`)."""
        with self._write_lock:
            configs = {tenant.name: tenant for tenant in tenants}
            added = [name for name in configs if name not in self._tenants]
            for name in list(self._tenants):
                if name not in configs:
                    self._owned.pop(name, None)
                    self._index.pop(name, None)
            self._tenants = configs
            for name in added:
                self._owned.setdefault(name, {})
                self._index.setdefault(name, {})
                index = self._read_index(name, set())
                if index:
                    self._index[name] = index
                    self._begin_load(name, index, limits_for[name])
            self._rebuild()

    def _load_entry(
        self,
        tenant: TenantConfig,
        owned: dict[str, Evaluator],
        entry: IndexEntry,
        module: LoadedModule | EvaldError,
    ) -> Evaluator:
        """One loaded index entry, held to the rules of registration: its name is not
        reserved, its module's manifest names it, its tag is not reserved and clashes with
        none of the tenant's other modules, and the tenant is within ``max_modules``.

        An index is the daemon's own file, but it is a file: edited by hand, restored from an
        old backup or damaged, it must not make a tenant's ``calc`` run the tenant's module.

        Raises:
            EvaldError: the rule it breaks, or why the module does not load.
        """
        if isinstance(module, EvaldError):
            raise module
        check_not_reserved(entry.name, entry.name, self._reserved)
        if module.manifest.name != entry.name:
            raise EvaldError(
                ErrorCode.INVALID_ARGUMENT,
                f"the index names the module {entry.sha256[:12]} {entry.name!r}, but its "
                f"manifest names it {module.manifest.name!r}",
            )
        self._check_rules(tenant, owned, entry.name, str(module.manifest.tag), replace=False)
        return Evaluator(name=entry.name, owner=tenant.name, module=module)

    def _persist(
        self,
        tenant: TenantConfig,
        name: str,
        wasm: bytes,
        replace: bool,
        *,
        token_sha256: str | None,
    ) -> None:
        """Stores one registration durably before it is served (caller holds the lock): the
        module file, then the tenant's index. The fleet store overrides it. ``token_sha256``
        is not needed here: the daemon's own config holds the tokens, checked at commit.

        Raises:
            EvaldError: ``unavailable`` when it could not be stored; nothing was kept.
        """
        sha256, created = self._store.put_module(wasm)
        index = dict(self._index.get(tenant.name, {}))
        index[name] = self._store.new_entry(name, sha256)
        try:
            self._store.write_index(tenant.name, index)
        except StoreError:
            if created:
                self._store.remove_module(sha256)
            raise
        self._index[tenant.name] = index

    def _persist_delete(self, tenant: TenantConfig, name: str, *, token_sha256: str | None) -> None:
        """Stores one deletion durably before the module stops being served (caller holds
        the lock). The fleet store overrides it.

        Raises:
            EvaldError: ``unavailable``: the index could not be written; nothing changed.
        """
        index = dict(self._index.get(tenant.name, {}))
        index.pop(name, None)
        self._store.write_index(tenant.name, index)
        self._index[tenant.name] = index

    def _forget_if_unused(self, sha256: str, evaluator: Evaluator | None) -> None:
        """Once no tenant's index refers to ``sha256``, removes its file and its compiled code
        (in memory and in the disk cache); caller holds the lock.

        Every index on disk counts, served or not. An index that cannot be read (corrupt, or
        unreadable when the daemon started) might refer to it: then everything is kept.
        """
        for tenant in self._store.tenant_names():
            index = None if tenant in self._unreadable else self._index.get(tenant)
            if index is None or tenant not in self._tenants:
                try:
                    index = self._store.read_index(tenant)
                except StoreError:
                    return
            if any(entry.sha256 == sha256 for entry in index.values()):
                return
        self._store.remove_module(sha256)
        if not any(ev.module.sha256 == sha256 for ev in self._standard.values()):
            self._host.discard_code(sha256)
        if evaluator is not None:
            self._host.forget(evaluator.module)
