"""Which evaluators exist and who may see them: the standard set plus each tenant's own modules.

Name resolution is always scoped to one tenant: it sees the standard evaluators its config allows
and the modules it registered, never another tenant's (a name it does not own resolves exactly as
a name that does not exist, so nothing leaks). The standard names and tags are reserved.

Readers (:meth:`Registry.resolve`, :meth:`Registry.visible`) run on the event loop for every
evaluation and take no lock: writers build new dictionaries and swap them in whole.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from evald.contract import STANDARD_EVALUATORS, ErrorCode, EvaldError, parse_manifest
from evald.daemon._config import TenantConfig
from evald.daemon._store import IndexEntry, ModuleStore, StoreError
from evald.host import (
    CompiledModule,
    Limits,
    LoadedModule,
    WasmHost,
    compile_module,
    peek_manifest_section,
)

__all__ = ["STANDARD_OWNER", "Evaluator", "Registry", "check_not_reserved"]

STANDARD_OWNER = "standard"

_log = logging.getLogger("evald.registry")


@dataclass(frozen=True)
class Evaluator:
    """A loaded evaluator and who owns it (``standard`` or a tenant name)."""

    name: str
    owner: str
    module: LoadedModule

    @property
    def tag(self) -> str:
        return str(self.module.manifest.tag)

    @property
    def semantics_version(self) -> str:
        return str(self.module.manifest.semantics_version)


def _shown(name: str) -> str:
    """A name as a log line shows it: at most 64 characters (a file may hold any string)."""
    return name if len(name) <= 64 else name[:64] + "..."


def check_not_reserved(name: str, tag: str, reserved: Iterable[str] = STANDARD_EVALUATORS) -> None:
    """Refuses a tenant module whose name or tag is a standard evaluator's name or tag.

    The daemon applies it at registration; ``evald build`` applies it too, so a tenant learns
    of the clash before uploading.

    Raises:
        EvaldError: ``INVALID_ARGUMENT`` naming the reserved word.
    """
    taken = frozenset(reserved)
    for word, what in ((name, "name"), (tag, "tag")):
        if word in taken:
            raise EvaldError(
                ErrorCode.INVALID_ARGUMENT,
                f"the {what} {word!r} is reserved for the standard evaluators; "
                "choose another in the module's manifest",
            )


class Registry:
    """The evaluators the daemon serves, per tenant.

    Thread-safety: :meth:`resolve` and :meth:`visible` may be called from any thread at any time;
    :meth:`register` and :meth:`delete` serialize on an internal lock and block (they compile
    and store modules), so call them from a worker thread.
    """

    def __init__(
        self,
        host: WasmHost,
        store: ModuleStore,
        tenants: Iterable[TenantConfig],
        *,
        compile: Callable[[bytes, int], CompiledModule] | None = None,
    ) -> None:
        """``compile(wasm, memory_cap)`` validates and compiles an uploaded module; the daemon
        passes its worker process (:class:`evald.host._compiler.Compiler`), the default compiles
        in-process."""
        self._host = host
        self._compile = compile or (
            lambda wasm, memory_cap: compile_module(host.config, wasm, memory_cap)
        )
        # Tenants whose index could not be read at start: their modules are not known, so
        # nothing they might refer to is removed, and their index is never overwritten.
        self._unreadable: set[str] = set()
        self._store = store
        self._tenants = {tenant.name: tenant for tenant in tenants}
        self._write_lock = threading.RLock()
        self._standard: dict[str, Evaluator] = {}
        # Standard names and tags, reserved whether or not the module is installed.
        self._reserved: frozenset[str] = frozenset(STANDARD_EVALUATORS)
        self._owned: dict[str, dict[str, Evaluator]] = {name: {} for name in self._tenants}
        self._index: dict[str, dict[str, IndexEntry]] = {name: {} for name in self._tenants}
        # Per tenant: every name and tag it can call -> evaluator. Rebuilt on every change.
        self._visible: dict[str, dict[str, Evaluator]] = {}
        #: Grows with every change served (ListEvaluators reports it).
        self.revision = 0
        #: Called with the new revision after each change (the embedded store persists it).
        self.on_change: Callable[[int], None] | None = None
        self._rebuild()

    # Loading ---------------------------------------------------------------------------------

    def load_standard(self, paths: dict[str, Path], limits: Limits) -> list[str]:
        """Loads the standard evaluators that are installed; a missing or broken one is logged
        and skipped so the daemon still serves the rest.

        Returns:
            The names loaded.
        """
        loaded: dict[str, Evaluator] = {}
        for name, path in paths.items():
            if not path.is_file():
                _log.warning(
                    "standard evaluator not installed",
                    extra={"fields": {"evaluator": name, "path": str(path)}},
                )
                continue
            try:
                module = self._host.load(path.read_bytes(), limits=limits)
            except (EvaldError, OSError) as exc:
                _log.error(
                    "standard evaluator failed to load",
                    extra={"fields": {"evaluator": name, "error": str(exc)}},
                )
                continue
            if module.manifest.name != name:
                _log.error(
                    "standard evaluator's manifest names another evaluator",
                    extra={"fields": {"evaluator": name, "manifest_name": module.manifest.name}},
                )
                continue
            loaded[name] = Evaluator(name=name, owner=STANDARD_OWNER, module=module)
        with self._write_lock:
            self._standard = loaded
            self._reserved = frozenset(
                {*STANDARD_EVALUATORS, *(evaluator.tag for evaluator in loaded.values())}
            )
            self._rebuild()
        return sorted(loaded)

    def load_registered(self, limits_for: dict[str, Limits]) -> dict[str, int]:
        """Reloads every module tenants registered before the last stop.

        Every entry is held to the rules of registration (:meth:`_load_entry`). An entry that
        breaks one, or whose module no longer loads (corrupt file, a limit lowered since), is
        logged, not served and left in the index, so fixing the config or the index brings it
        back; the tenant's other modules are served. Indexes of tenants that are no longer
        configured are kept on disk and not served. Unreferenced module files are removed.

        Returns:
            Evaluators loaded per tenant.
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
                counts[tenant] = self._serve_index(tenant, index, limits_for[tenant])
            self._rebuild()
        removed = self._store.collect_garbage(referenced)
        # Compiled code of modules nobody refers to any more (refused or deleted before a
        # crash, or compiled by an older wasmtime).
        standard = {evaluator.module.sha256 for evaluator in self._standard.values()}
        removed += self._host.collect_cache(referenced | standard)
        if removed:
            _log.info("removed unreferenced files", extra={"fields": {"files": removed}})
        return counts

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

    def _serve_index(self, tenant: str, index: dict[str, IndexEntry], limits: Limits) -> int:
        """Loads and serves one tenant's index (caller holds the lock); returns how many of
        its entries are served."""
        self._index[tenant] = index
        owned: dict[str, Evaluator] = {}
        config = self._tenants[tenant]
        past_cap = 0
        for entry in index.values():
            if len(owned) >= config.max_modules:
                past_cap += 1  # not loaded at all: one line says how many
                continue
            try:
                owned[entry.name] = self._load_entry(config, owned, entry, limits)
            except EvaldError as exc:
                _log.error(
                    "registered module not served",
                    extra={
                        "fields": {
                            "tenant": tenant,
                            "evaluator": _shown(entry.name),
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
        tenant's config (evaluators, may-register, max modules) applies at once. Blocking."""
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
                    self._serve_index(name, index, limits_for[name])
            self._rebuild()

    def _load_entry(
        self,
        tenant: TenantConfig,
        owned: dict[str, Evaluator],
        entry: IndexEntry,
        limits: Limits,
    ) -> Evaluator:
        """One index entry, loaded and held to the rules of registration: its name is not
        reserved, its module's manifest names it, its tag is not reserved and clashes with
        none of the tenant's other modules, and the tenant is within ``max_modules``.

        An index is the daemon's own file, but it is a file: edited by hand, restored from an
        old backup or damaged, it must not make a tenant's ``calc`` run the tenant's module.

        Raises:
            EvaldError: the rule it breaks, or why the module does not load.
        """
        check_not_reserved(entry.name, entry.name, self._reserved)
        wasm = self._store.read_module(entry.sha256)
        module = self._host.load(wasm, limits=limits)
        if module.manifest.name != entry.name:
            raise EvaldError(
                ErrorCode.INVALID_ARGUMENT,
                f"the index names the module {entry.sha256[:12]} {entry.name!r}, but its "
                f"manifest names it {module.manifest.name!r}",
            )
        self._check_rules(tenant, owned, entry.name, str(module.manifest.tag), replace=False)
        return Evaluator(name=entry.name, owner=tenant.name, module=module)

    def _rebuild(self) -> None:
        visible: dict[str, dict[str, Evaluator]] = {}
        for name, tenant in self._tenants.items():
            table: dict[str, Evaluator] = {}
            allowed = [ev for ev in self._standard.values() if tenant.may_use_standard(ev.name)]
            for evaluator in (*allowed, *self._owned.get(name, {}).values()):
                table.setdefault(evaluator.tag, evaluator)
            # Names win over tags: set them last.
            for evaluator in (*allowed, *self._owned.get(name, {}).values()):
                table[evaluator.name] = evaluator
            visible[name] = table
        self._visible = visible

    # Reading ---------------------------------------------------------------------------------

    def resolve(self, tenant: str, name_or_tag: str) -> Evaluator:
        """The evaluator ``tenant`` means by ``name_or_tag`` (a name first, then a tag).

        Raises:
            EvaldError: ``unknown_evaluator`` when the tenant has nothing by that name (another
                tenant's module included); ``permission_denied`` for a standard evaluator the
                tenant's config does not allow.
        """
        evaluator = self._visible.get(tenant, {}).get(name_or_tag)
        if evaluator is not None:
            return evaluator
        standard = self._standard.get(name_or_tag) or next(
            (ev for ev in self._standard.values() if ev.tag == name_or_tag), None
        )
        config = self._tenants.get(tenant)
        standard_name = standard.name if standard is not None else None
        if standard_name is None and name_or_tag in STANDARD_EVALUATORS:
            standard_name = name_or_tag
        if standard_name is not None:
            if config is None or not config.may_use_standard(standard_name):
                raise EvaldError(
                    ErrorCode.PERMISSION_DENIED,
                    f"tenant {tenant!r} may not use the standard evaluator {standard_name!r} "
                    "(add it to the tenant's `evaluators` in the daemon config)",
                )
            raise EvaldError(
                ErrorCode.UNKNOWN_EVALUATOR,
                f"the standard evaluator {standard_name!r} is not installed on this daemon "
                "(build it with `make wasm`)",
            )
        shown = name_or_tag if len(name_or_tag) <= 64 else name_or_tag[:64] + "..."
        raise EvaldError(
            ErrorCode.UNKNOWN_EVALUATOR,
            f"no evaluator {shown!r} for tenant {tenant!r} (`evald evaluators` lists them)",
        )

    def visible(self, tenant: str) -> list[Evaluator]:
        """Every evaluator ``tenant`` may call, standard first, each once, sorted by name."""
        unique = {ev.name: ev for ev in self._visible.get(tenant, {}).values()}
        return sorted(unique.values(), key=lambda ev: (ev.owner != STANDARD_OWNER, ev.name))

    def owned_count(self, tenant: str) -> int:
        """How many modules ``tenant`` has registered."""
        return len(self._owned.get(tenant, {}))

    # Writing ---------------------------------------------------------------------------------

    def register(
        self, tenant: TenantConfig, wasm: bytes, limits: Limits, replace: bool
    ) -> Evaluator:
        """Validates, stores and serves a tenant's module. Blocking: call from a worker thread.

        Everything cheap is checked before anything is compiled: the permission, the tenant's
        index, the size cap, and (from the manifest, read without parsing the code) the name,
        the tag and ``max_modules``. Compilation then runs through ``compile`` (the daemon's
        worker process); nothing is cached until the module is accepted, so a refusal leaves
        no compiled code in memory or on disk.

        Raises:
            EvaldError: ``permission_denied`` (registration not allowed), ``invalid_module`` (the
                host's validator refused it), ``invalid_argument`` (name taken or reserved, too
                many modules), ``unavailable`` (the store could not write, or the tenant's index
                is unreadable; nothing was kept).
        """
        if not tenant.allow_register:
            raise EvaldError(
                ErrorCode.PERMISSION_DENIED,
                f"tenant {tenant.name!r} may not register evaluators "
                "(set allow_register = true for it in the daemon config)",
            )
        self._check_index_readable(tenant.name)
        module_bytes = self._host.config.module_bytes
        if len(wasm) > module_bytes:
            raise EvaldError(
                ErrorCode.INVALID_MODULE,
                f"the module is {len(wasm)} bytes; the module size cap is {module_bytes} bytes "
                "(build with -O ReleaseSmall, strip debug sections, or ask for a larger cap)",
            )
        payload = peek_manifest_section(wasm)
        with self._write_lock:
            if payload is not None:
                early = parse_manifest(payload)
                self._check_name(tenant, early.name, early.tag, replace)
            elif not replace:
                self._check_room(tenant, dict(self._owned.get(tenant.name, {})), None)
        compiled = self._compile(wasm, self._host.memory_cap(limits))
        module = self._host.adopt(wasm, compiled, limits=limits)
        name = str(module.manifest.name)
        with self._write_lock:
            self._check_index_readable(tenant.name)
            owned = self._check_name(tenant, name, str(module.manifest.tag), replace)
            replaced = owned.get(name)
            self._persist(tenant, name, wasm, replace)
            evaluator = Evaluator(name=name, owner=tenant.name, module=module)
            owned[name] = evaluator
            self._owned[tenant.name] = owned
            self._rebuild()
            self._host.store_compiled(module)
            if replaced is not None and replaced.module.sha256 != module.sha256:
                self._forget_if_unused(replaced.module.sha256, replaced)
            self._changed()
        return evaluator

    def _persist(self, tenant: TenantConfig, name: str, wasm: bytes, replace: bool) -> None:
        """Stores one registration durably before it is served (caller holds the lock): the
        module file, then the tenant's index. The fleet store overrides it.

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

    def _persist_delete(self, tenant: TenantConfig, name: str) -> None:
        """Stores one deletion durably before the module stops being served (caller holds
        the lock). The fleet store overrides it.

        Raises:
            EvaldError: ``unavailable``: the index could not be written; nothing changed.
        """
        index = dict(self._index.get(tenant.name, {}))
        index.pop(name, None)
        self._store.write_index(tenant.name, index)
        self._index[tenant.name] = index

    def _changed(self) -> None:
        """One change was applied (caller holds the lock): the revision grows."""
        self.revision += 1
        if self.on_change is not None:
            self.on_change(self.revision)

    def tenant_configs(self) -> dict[str, TenantConfig]:
        """The tenants served now, by name."""
        return dict(self._tenants)

    def _check_index_readable(self, tenant: str) -> None:
        if tenant in self._unreadable:
            raise EvaldError(
                ErrorCode.UNAVAILABLE,
                f"the index of tenant {tenant!r} could not be read when the daemon started; "
                "an operator must repair tenants/" + tenant + ".json in the state folder and "
                "restart the daemon (nothing is changed until then)",
            )

    def _check_room(
        self, tenant: TenantConfig, owned: dict[str, Evaluator], name: str | None
    ) -> None:
        if (name is None or name not in owned) and len(owned) >= tenant.max_modules:
            raise EvaldError(
                ErrorCode.INVALID_ARGUMENT,
                f"tenant {tenant.name!r} already has {len(owned)} evaluators, its maximum "
                "(delete one, or raise max_modules in the daemon config)",
            )

    def _check_name(
        self, tenant: TenantConfig, name: str, tag: str, replace: bool
    ) -> dict[str, Evaluator]:
        """The name, tag and count rules (caller holds the lock); returns a copy of the
        tenant's modules."""
        owned = dict(self._owned.get(tenant.name, {}))
        self._check_rules(tenant, owned, name, tag, replace)
        return owned

    def _check_rules(
        self,
        tenant: TenantConfig,
        owned: dict[str, Evaluator],
        name: str,
        tag: str,
        replace: bool,
    ) -> None:
        """The name, tag and count rules against ``owned``, the tenant's other modules; the
        same at registration and at load."""
        check_not_reserved(name, tag, self._reserved)
        for other in owned.values():
            if other.name == name:
                continue
            if tag in (other.name, other.tag) or name == other.tag:
                raise EvaldError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"the manifest's name {name!r} or tag {tag!r} clashes with your "
                    f"evaluator {other.name!r} (tag {other.tag!r})",
                )
        if name in owned and not replace:
            raise EvaldError(
                ErrorCode.INVALID_ARGUMENT,
                f"you already have an evaluator {name!r}; register with replace to update it "
                "(`evald register --replace`)",
            )
        self._check_room(tenant, owned, name)

    def delete(self, tenant: TenantConfig, name: str) -> Evaluator:
        """Stops serving and removes one of the tenant's modules.

        Raises:
            EvaldError: ``permission_denied`` for a standard evaluator, ``unknown_evaluator``
                when the tenant owns nothing by that name, ``unavailable`` when the index write
                failed (the module is still registered then).
        """
        with self._write_lock:
            owned = dict(self._owned.get(tenant.name, {}))
            evaluator = owned.get(name)
            if evaluator is not None:
                self._check_index_readable(tenant.name)
            if evaluator is None:
                if name in self._reserved:
                    raise EvaldError(
                        ErrorCode.PERMISSION_DENIED,
                        f"{name!r} is a standard evaluator and cannot be deleted",
                    )
                raise EvaldError(
                    ErrorCode.UNKNOWN_EVALUATOR,
                    f"tenant {tenant.name!r} has no registered evaluator {name!r}",
                )
            self._persist_delete(tenant, name)
            del owned[name]
            self._owned[tenant.name] = owned
            self._rebuild()
            self._forget_if_unused(evaluator.module.sha256, evaluator)
            self._changed()
        return evaluator

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
