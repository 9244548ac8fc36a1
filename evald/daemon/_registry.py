"""Which evaluators exist and who may see them: the standard set plus each tenant's own modules.

Name resolution is always scoped to one tenant: it sees the standard evaluators its config allows
and the modules it registered, never another tenant's (a name it does not own resolves exactly as
a name that does not exist, so nothing leaks). The standard names and tags are reserved.

Readers (:meth:`Registry.resolve`, :meth:`Registry.visible`) run on the event loop for every
evaluation and take no lock: writers build new dictionaries and swap them in whole.

Module work never runs on the daemon's control thread (:mod:`evald.daemon._control_threads`):
a registration is checked and compiled (:meth:`Registry.prepare_upload`, the module thread),
then committed (:meth:`Registry.commit_upload`, the control thread, where the rules are checked
again); a tenant's stored modules are loaded on the module thread and served by a job on the
control thread (:attr:`Registry.schedule`). Until a tenant's modules are served, a name it has
no evaluator for yet is answered ``unavailable`` (loading, retry), not ``unknown_evaluator``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evald.contract import STANDARD_EVALUATORS, ErrorCode, EvaldError, parse_manifest
from evald.daemon._config import TenantConfig
from evald.daemon._store import IndexEntry, ModuleStore
from evald.host import (
    CompiledModule,
    Limits,
    LoadedModule,
    WasmHost,
    compile_module,
    peek_manifest_section,
)

__all__ = [
    "STANDARD_OWNER",
    "Evaluator",
    "Registry",
    "check_not_reserved",
    "check_storable",
    "shown",
]

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


def shown(name: str) -> str:
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


def check_storable(manifest: bytes) -> None:
    """Refuses a manifest whose text no store can keep: a NUL (U+0000) or a lone surrogate in
    any string, key or value. PostgreSQL's ``text`` and ``jsonb`` refuse both, and protobuf
    cannot send a lone surrogate: accepted, such a manifest failed at the store's write as
    ``unavailable ... retry``, an outage for what is a permanent refusal. Malformed JSON is
    left to the manifest's own parser, which says why.

    Raises:
        EvaldError: ``invalid_module`` naming the field.
    """
    try:
        document = json.loads(manifest)
    except (ValueError, RecursionError):
        return
    pending: list[tuple[str, object]] = [("", document)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, dict):
            pending.extend((f"{where}.{key}".lstrip("."), key) for key in value)
            pending.extend((f"{where}.{key}".lstrip("."), item) for key, item in value.items())
        elif isinstance(value, list):
            pending.extend((f"{where}[{index}]", item) for index, item in enumerate(value))
        elif isinstance(value, str):
            what = "a NUL character (U+0000)" if "\x00" in value else _unencodable(value)
            if what:
                raise EvaldError(
                    ErrorCode.INVALID_MODULE,
                    f"the manifest's {shown(where) or 'document'} holds {what}, which no evald "
                    "store can keep; remove it from the manifest and build the module again",
                )


def _unencodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "a lone surrogate (not valid UTF-8)"
    return ""


class Registry:
    """The evaluators the daemon serves, per tenant; a store's registry says where
    registrations are kept (:class:`~evald.daemon._indexed_registry.IndexedRegistry`: the state
    folder; :class:`~evald.daemon._fleet.FleetRegistry`: the fleet store).

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
        #: Called with ``(tenant, name)`` when one of a tenant's evaluators stops being served
        #: (deleted, or no longer in the store); not when it is replaced.
        self.on_removed: Callable[[str, str], None] | None = None
        #: ``schedule(load, apply)`` runs ``load`` off the control thread and then
        #: ``apply(its result)`` on it (the daemon's :class:`ControlThreads`); None: both at
        #: once, on the calling thread.
        self.schedule: Callable[[Callable[[], Any], Callable[[Any], None]], None] | None = None
        #: Per tenant: loads of its stored modules not yet served.
        self._loading: dict[str, int] = {}
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

    def set_tenants(self, tenants: Iterable[TenantConfig], limits_for: dict[str, Limits]) -> None:
        """Serves ``tenants`` from now on (a live reload, the store's tenants): a removed
        tenant's modules are no longer served, a changed tenant's config (evaluators,
        may-register, max modules) applies at once. ``limits_for`` are the tenants' limits
        (for a store that loads a new tenant's modules)."""
        with self._write_lock:
            configs = {tenant.name: tenant for tenant in tenants}
            for name in list(self._owned):
                if name not in configs:
                    del self._owned[name]
            for name in configs:
                self._owned.setdefault(name, {})
            self._tenants = configs
            self._rebuild()

    def is_loading(self) -> bool:
        """Whether any tenant's stored modules are still loading."""
        return bool(self._loading)

    def loading(self, tenant: str, delta: int) -> None:
        """Counts one load of ``tenant``'s stored modules begun (+1) or served (-1); while any
        is pending the tenant is *loading* (see the module)."""
        with self._write_lock:
            left = self._loading.get(tenant, 0) + delta
            if left > 0:
                self._loading[tenant] = left
            else:
                self._loading.pop(tenant, None)

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
                tenant's config does not allow; ``unavailable`` while the tenant's modules are
                loading (the name may be one of them).
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
        if self._loading.get(tenant):
            raise EvaldError(
                ErrorCode.UNAVAILABLE,
                f"tenant {tenant!r}'s evaluators are still loading (the daemon started, or its "
                "store changed, moments ago); retry shortly",
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
        """:meth:`prepare_upload` then :meth:`commit_upload`, on the calling thread."""
        module = self.prepare_upload(tenant, wasm, limits, replace)
        return self.commit_upload(tenant, wasm, module, replace)

    def prepare_upload(
        self, tenant: TenantConfig, wasm: bytes, limits: Limits, replace: bool
    ) -> LoadedModule:
        """Checks and compiles a tenant's upload; serves nothing. Blocking: the daemon runs it
        on its module thread.

        Everything cheap is checked before anything is compiled: the permission, the tenant's
        index, the size cap, and (from the manifest, read without parsing the code) the name,
        the tag and ``max_modules``. Compilation then runs through ``compile`` (the daemon's
        worker process); nothing is cached until the module is accepted, so a refusal leaves
        no compiled code in memory or on disk.

        Raises:
            EvaldError: ``permission_denied`` (registration not allowed), ``invalid_module`` (the
                host's validator refused it), ``invalid_argument`` (name taken or reserved, too
                many modules), ``unavailable`` (the tenant's index is unreadable, or its modules
                are still loading).
        """
        self._check_may_register(tenant)
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
                check_storable(payload)
                early = parse_manifest(payload)
                self._check_name(tenant, early.name, early.tag, replace)
            elif not replace:
                self._check_room(tenant, dict(self._owned.get(tenant.name, {})), None)
        compiled = self._compile(wasm, self._host.memory_cap(limits))
        return self._host.adopt(wasm, compiled, limits=limits)

    def commit_upload(
        self,
        tenant: TenantConfig,
        wasm: bytes,
        module: LoadedModule,
        replace: bool,
        *,
        token_sha256: str | None = None,
    ) -> Evaluator:
        """Stores and serves a module :meth:`prepare_upload` compiled, holding it to the rules
        again under ``tenant``'s config now (a registration of the same name may have committed
        meanwhile). The daemon runs it on its control thread, after checking that the call's
        token still names ``tenant``; ``token_sha256`` is that token's hash (None: no token),
        which the fleet store checks again as it writes.

        Raises:
            EvaldError: as :meth:`prepare_upload` (nothing compiles here), or ``unavailable``
                (the store could not write; nothing was kept).
        """
        name = str(module.manifest.name)
        with self._write_lock:
            self._check_may_register(tenant)
            owned = self._check_name(tenant, name, str(module.manifest.tag), replace)
            replaced = owned.get(name)
            self._persist(tenant, name, wasm, replace, token_sha256=token_sha256)
            evaluator = Evaluator(name=name, owner=tenant.name, module=module)
            owned[name] = evaluator
            self._owned[tenant.name] = owned
            self._rebuild()
            self._host.store_compiled(module)
            if replaced is not None and replaced.module.sha256 != module.sha256:
                self._forget_if_unused(replaced.module.sha256, replaced)
            self._changed()
        return evaluator

    def _check_may_register(self, tenant: TenantConfig) -> None:
        if not tenant.allow_register:
            raise EvaldError(
                ErrorCode.PERMISSION_DENIED,
                f"tenant {tenant.name!r} may not register evaluators "
                "(set allow_register = true for it in the daemon config)",
            )
        self._check_index_readable(tenant.name)
        self._check_not_loading(tenant.name)

    def _check_not_loading(self, tenant: str) -> None:
        """Refuses a change to a tenant whose stored modules are not served yet: the rules
        (names, ``max_modules``) would be checked against part of them."""
        if self._loading.get(tenant):
            raise EvaldError(
                ErrorCode.UNAVAILABLE,
                f"tenant {tenant!r}'s evaluators are still loading (the daemon started moments "
                "ago); retry shortly",
            )

    def _persist(
        self,
        tenant: TenantConfig,
        name: str,
        wasm: bytes,
        replace: bool,
        *,
        token_sha256: str | None,
    ) -> None:
        """Stores one registration durably before it is served (caller holds the lock);
        ``token_sha256``: the hash of the token of the call that asked (None: no token).

        Raises:
            EvaldError: ``unavailable`` when it could not be stored; nothing was kept.
        """
        raise NotImplementedError

    def _persist_delete(self, tenant: TenantConfig, name: str, *, token_sha256: str | None) -> None:
        """Stores one deletion durably before the module stops being served (caller holds
        the lock); ``token_sha256`` as for :meth:`_persist`.

        Raises:
            EvaldError: ``unavailable``: nothing changed.
        """
        raise NotImplementedError

    def _forget_if_unused(self, sha256: str, evaluator: Evaluator | None) -> None:
        """Drops the compiled code of ``evaluator`` once nobody here serves ``sha256``
        (caller holds the lock)."""
        if evaluator is None or self.serves(sha256):
            return
        self._host.forget(evaluator.module)

    def serves(self, sha256: str) -> bool:
        """Whether any tenant's evaluator served now runs the module ``sha256``."""
        return any(
            ev.module.sha256 == sha256 for owned in self._owned.values() for ev in owned.values()
        )

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

    def delete(
        self, tenant: TenantConfig, name: str, *, token_sha256: str | None = None
    ) -> Evaluator:
        """Stops serving and removes one of the tenant's modules (``token_sha256``: as for
        :meth:`commit_upload`).

        Raises:
            EvaldError: ``permission_denied`` for a standard evaluator, ``unknown_evaluator``
                when the tenant owns nothing by that name, ``unavailable`` when the index write
                failed (the module is still registered then).
        """
        with self._write_lock:
            owned = dict(self._owned.get(tenant.name, {}))
            self._check_not_loading(tenant.name)
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
            self._persist_delete(tenant, name, token_sha256=token_sha256)
            del owned[name]
            self._owned[tenant.name] = owned
            self._rebuild()
            self._forget_if_unused(evaluator.module.sha256, evaluator)
            self._changed()
        if self.on_removed is not None:
            self.on_removed(tenant.name, name)
        return evaluator
