"""The fleet store as one daemon sees it: following PostgreSQL, and a local cache for when it is
down.

Why this shape: every daemon of a fleet must serve the same tenants, tokens, limits and modules,
change for change, without a restart, and keep serving when the store is away. So:

* the store's revision is the truth and ``LISTEN/NOTIFY`` only the prompt. A follower thread
  listens on :data:`~evald.daemon._postgres.CHANNEL`; on a notification, and every ``poll_s``
  besides, the daemon reads what changed since the revision it applied
  (:meth:`~evald.daemon._postgres.Database.changes`, one snapshot) and applies it. After any
  reconnect it listens first, then reads a full copy and applies the difference, so no change
  is missed, a change already served is not applied again (same module hash: nothing to do),
  and what it serves is always the store's state at one revision, in order;
* module bytes are checked against their hash before anything is compiled; a module fetched
  from the store compiles in the daemon's sandboxed compile worker, once per daemon (its code
  then comes from the host's disk cache). Modules load on the daemon's module thread, never on
  the control thread (:mod:`evald.daemon._control_threads`): tenants and tokens apply at once,
  a new evaluator is served once loaded (until then its tenant's unknown names answer
  ``unavailable``, retry), a replaced one keeps its old module until the new one is loaded,
  and the revision the daemon reports moves only once every module of it is served;
* after each revision the daemon writes its local cache: the modules into the state folder's
  ``modules/`` (as the embedded store keeps them) and ``fleet.json`` (the revision, the store's
  tenants and every tenant's evaluators), read back with the same checked reading code
  (:mod:`evald.daemon._state_files`). A daemon started while the store is down serves from it;
  a cached module that fails its hash is refused and fetched again once the store is back.

Everything that changes what the daemon serves runs on the daemon's one control thread
(registrations' commits too), so the follower and a registration never apply at once. While the
store is unreachable the daemon serves what it has, says so (health service
``evald.v1.Store`` NOT_SERVING, ``evald_store_connected`` 0) and answers registrations
``unavailable``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any, Final

from evald.contract import ErrorCode, EvaldError
from evald.daemon._background_loads import BackgroundLoads, LoadKey, StillLoading
from evald.daemon._config import Config, ConfigError, TenantConfig, tenant_from_store
from evald.daemon._control_store import StoreDaemon
from evald.daemon._postgres import ChangeSet, Database, EvaluatorRow
from evald.daemon._registry import Evaluator, Registry, check_not_reserved
from evald.daemon._state_files import StateFileError, atomic_write, read_json
from evald.daemon._store import ModuleStore, is_sha256
from evald.host import CompiledModule, Limits, LoadedModule, WasmHost, peek_manifest_section

__all__ = ["CACHE_FILE", "FleetRegistry", "FleetStore"]

_log = logging.getLogger("evald.store")

#: The local cache's index, beside the cached modules.
CACHE_FILE: Final = "fleet.json"
_CACHE_VERSION: Final = 1
_MAX_CACHE_BYTES: Final = 16 * 1024 * 1024
_MAX_CACHE_DEPTH: Final = 8
#: How long the follower waits between attempts to reach the store, at most.
_BACKOFF_MAX_S: Final = 2.0
#: How often the follower looks up from waiting for a notification (to notice a stop).
_WAKE_S: Final = 0.25


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
    ) -> None:
        super().__init__(host, cache, tenants, compile=compile)
        self._database = database
        self._committed = committed
        self.compile_upload = compile

    def commit_upload(
        self, tenant: TenantConfig, wasm: bytes, module: LoadedModule, replace: bool
    ) -> Evaluator:
        evaluator = super().commit_upload(tenant, wasm, module, replace)
        self._committed()  # catch up to the revision that carries it (and any before it)
        return evaluator

    def _check_not_loading(self, tenant: str) -> None:
        """The store checks the rules against every module of the tenant: nothing to wait for."""

    def delete(self, tenant: TenantConfig, name: str) -> Evaluator:
        evaluator = super().delete(tenant, name)
        self._committed()
        return evaluator

    def _persist(self, tenant: TenantConfig, name: str, wasm: bytes, replace: bool) -> None:
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
        )
        try:
            self._store.put_module(wasm)  # the local cache: a restart without the store
        except StateFileError as exc:
            _log.warning("module not cached locally", extra={"fields": {"error": exc.message}})

    def _persist_delete(self, tenant: TenantConfig, name: str) -> None:
        if tenant.source != "store":
            raise EvaldError(
                ErrorCode.PERMISSION_DENIED,
                f"tenant {tenant.name!r} is defined in this daemon's config, not in the "
                "fleet store",
            )
        self._database.delete(tenant.name, name)

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


class FleetStore:
    """The fleet store for one daemon: the database, the follower thread and the local cache.

    Lifecycle: :meth:`make_registry`, then :meth:`load` (blocking, on the control thread:
    applies the store's state, or the local cache when the store is down, and starts the
    follower), :meth:`reload` (SIGHUP: the config's own tenants again, and a full read of the
    store), :meth:`close`.
    """

    kind: Final = "postgresql"

    def __init__(
        self, config: Config, daemon: StoreDaemon, cache: ModuleStore, control: Executor
    ) -> None:
        self._config = config
        self._daemon = daemon
        self._cache = cache
        self._control = control
        # Named by pid, so an operator (or a test) can tell each daemon's sessions apart.
        self.database = Database(config.store, application=f"evald-{os.getpid()}")
        self._registry: FleetRegistry | None = None
        self._host: WasmHost | None = None
        self.applied = 0  # the store revision this daemon serves
        self._store_tenants: dict[str, dict[str, Any]] = {}
        self._wanted: dict[str, dict[str, str]] = {}  # tenant -> name -> module hash
        self._failed: set[tuple[str, str, str]] = set()  # logged once (retried, not logged again)
        self._loads: BackgroundLoads | None = None  # evaluators on the module thread
        self._cache_due = False  # a revision applied from the store, not yet in the cache
        self._local = {tenant.name: tenant for tenant in config.tenants}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.problem: str | None = None
        self._shadowed_logged: set[str] = set()

    # Lifecycle ------------------------------------------------------------------------------

    def make_registry(
        self, host: WasmHost, compile: Callable[[bytes, int], CompiledModule]
    ) -> FleetRegistry:
        self._host = host
        self._registry = FleetRegistry(
            host,
            self._cache,
            self._config.tenants,
            compile=compile,
            database=self.database,
            committed=lambda: self.sync(full=False),
        )
        self._loads = BackgroundLoads(self._registry, wanted=self._wants, drop=self._drop)
        return self._registry

    def _wants(self, key: LoadKey) -> bool:
        tenant, name, sha256 = key
        return self._wanted.get(tenant, {}).get(name) == sha256

    def _drop(self, evaluator: Evaluator) -> None:
        if self._host is not None and not self._require_registry().serves(evaluator.module.sha256):
            self._host.forget(evaluator.module)

    def load(self) -> dict[str, int]:
        """The store's state (or, when it is down, the local cache's), applied; then the
        follower starts. Blocking: run on the control thread. The daemon always starts."""
        try:
            self.sync(full=True)
        except EvaldError as exc:
            self._unreachable(exc.message)
            cached = self._read_cache()
            if cached is not None:
                _log.warning(
                    "fleet store unreachable at start: serving the local cache",
                    extra={"fields": {"revision": cached.head, "error": exc.message}},
                )
                self._apply(cached, fetch=False)
            else:
                _log.warning(
                    "fleet store unreachable at start and no local cache: serving the "
                    "config's tenants only",
                    extra={"fields": {"error": exc.message}},
                )
        self._thread = threading.Thread(target=self._follow, name="evald-store", daemon=True)
        self._thread.start()
        return {name: len(names) for name, names in self._wanted.items()}

    def catch_up(self) -> None:
        """Applies what the store changed since the applied revision (control thread)."""
        self.sync(full=False)

    def reload(self, config: Config) -> None:
        """SIGHUP: takes the config's own tenants again and reads the whole store."""
        self._local = {tenant.name: tenant for tenant in config.tenants}
        try:
            self.sync(full=True)
        except EvaldError as exc:
            _log.warning(
                "fleet store unreachable on reload", extra={"fields": {"error": exc.message}}
            )
            self._apply_tenants()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self.database.close()

    def _require_registry(self) -> FleetRegistry:
        assert self._registry is not None, "make_registry() has not run"
        return self._registry

    def _require_loads(self) -> BackgroundLoads:
        assert self._loads is not None, "make_registry() has not run"
        return self._loads

    # Following ------------------------------------------------------------------------------

    def _follow(self) -> None:
        """The follower thread: listen, read what changed, apply it on the control thread;
        after a lost connection, reconnect with backoff and read everything."""
        backoff = 0.1
        poll_s = self._config.store.poll_s
        while not self._stop.is_set():
            conn = None
            try:
                conn = self.database.listen()  # listening first: nothing committed after is missed
                self._on_control(lambda: self.sync(full=True))
                self._reachable()
                backoff = 0.1
                next_poll = time.monotonic() + poll_s
                while not self._stop.is_set():
                    notified = False
                    for _notice in conn.notifies(timeout=_WAKE_S, stop_after=1):
                        notified = True
                    if notified or time.monotonic() >= next_poll:
                        self._on_control(lambda: self.sync(full=False))
                        next_poll = time.monotonic() + poll_s
            except EvaldError as exc:
                self._unreachable(exc.message)
            except RuntimeError:  # the control thread is gone: the daemon stops
                return
            except Exception as exc:  # psycopg's errors on a broken connection
                from evald.daemon._postgres import describe_error

                self._unreachable(describe_error(exc, self.database.password))
            finally:
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:
                        pass
            self._stop.wait(backoff)
            backoff = min(_BACKOFF_MAX_S, backoff * 2)

    def _on_control(self, function: Callable[[], None]) -> None:
        self._control.submit(function).result()

    def _unreachable(self, reason: str) -> None:
        if self.problem is None:
            _log.warning("fleet store unreachable", extra={"fields": {"error": reason}})
        self.problem = f"the fleet store is unreachable: {reason}"
        self._daemon.store_health(self.problem)

    def _reachable(self) -> None:
        if self.problem is not None:
            _log.info("fleet store reachable again", extra={"fields": {"revision": self.applied}})
        self.problem = None
        self._daemon.store_health(None)

    def sync(self, *, full: bool) -> None:
        """Reads what changed since the applied revision (everything when ``full``) and
        applies it. Run on the control thread.

        Raises:
            EvaldError: ``unavailable`` (the store is unreachable).
        """
        changes = self.database.changes(self.applied, full=full)
        if not full and changes.head <= self.applied:
            return
        self._apply(changes, fetch=True)

    # Applying -------------------------------------------------------------------------------

    def _apply(self, changes: ChangeSet, *, fetch: bool) -> None:
        registry = self._require_registry()
        if changes.full:
            self._store_tenants = {}
            self._wanted = {}
        for row in changes.tenants:
            self._store_tenants[str(row["name"])] = row
        self._apply_tenants()
        touched: set[str] = set(self._wanted) if changes.full else set()
        for evaluator in changes.evaluators:
            touched.add(evaluator.tenant)
            names = self._wanted.setdefault(evaluator.tenant, {})
            if evaluator.sha256 is None:
                names.pop(evaluator.name, None)
            else:
                names[evaluator.name] = evaluator.sha256
        if changes.full:
            touched.update(self._wanted)
            touched.update(registry.owners())
        self._require_loads().retry(touched)
        previous = self.applied
        self.applied = max(self.applied, changes.head) if not changes.full else changes.head
        self._cache_due = self._cache_due or fetch
        self._serve_wanted(touched, fetch=fetch)
        if changes.revisions or changes.full:
            _log.info(
                "store revision applied",
                extra={
                    "fields": {
                        "from": previous,
                        "to": self.applied,
                        "revisions": list(changes.revisions),
                        "full": changes.full,
                        "cache": not fetch,
                    }
                },
            )

    def _serve_wanted(self, tenants: Iterable[str], *, fetch: bool) -> None:
        """Serves what the store wants of ``tenants`` that is loaded, starts loading the rest on
        the module thread (:meth:`_load`), and once nothing is loading, reports the applied
        revision and writes the local cache. Control thread."""
        registry = self._require_registry()

        def load(tenant: TenantConfig, name: str, sha256: str) -> Evaluator:
            return self._load(tenant, name, sha256, fetch=fetch)

        registry.apply_evaluators(self._wanted, sorted(tenants), load)
        if self._require_loads().pending:
            return
        registry.revision = self.applied
        if self._cache_due:
            self._cache_due = False
            self._write_cache()

    def _apply_tenants(self) -> None:
        """The config's own tenants and the store's, to the daemon (a store tenant with a
        config tenant's name is not served: logged once)."""
        configs = dict(self._local)
        defaults = self._config.default_limits
        for name, row in sorted(self._store_tenants.items()):
            if name in configs:
                if name not in self._shadowed_logged:
                    self._shadowed_logged.add(name)
                    _log.warning(
                        "a fleet store tenant has the name of a tenant of this daemon's config: "
                        "the config's is served",
                        extra={"fields": {"tenant": name}},
                    )
                continue
            try:
                configs[name] = tenant_from_store(row, defaults, f"fleet store tenant {name!r}")
            except ConfigError as exc:
                _log.error("fleet store tenant not served", extra={"fields": {"error": str(exc)}})
        self._daemon.apply_tenants(list(configs.values()))

    def _load(self, tenant: TenantConfig, name: str, sha256: str, *, fetch: bool) -> Evaluator:
        """One evaluator of the store if loaded; else its load (:meth:`_load_now`) starts on
        the module thread and the tenant is served again once it is done (control thread).

        Raises:
            StillLoading: it is being loaded.
            EvaldError: why it is not served (it did not load).
        """
        return self._require_loads().take(
            (tenant.name, name, sha256),
            lambda: self._load_now(tenant, name, sha256, fetch=fetch),
            lambda tenant_name: self._serve_wanted([tenant_name], fetch=fetch),
        )

    def _load_now(self, tenant: TenantConfig, name: str, sha256: str, *, fetch: bool) -> Evaluator:
        """One evaluator of the store: its bytes from the local cache (checked against the
        hash) or else from the store (checked, then compiled in the sandboxed worker), held to
        the rules; a failure is logged once (tried again at each full read) and raised.

        Raises:
            EvaldError: why it is not served.
        """
        registry = self._require_registry()
        host = self._host
        assert host is not None
        limits = self._daemon.limits_of(tenant.name)
        try:
            try:
                wasm = self._cache.read_module(sha256)
                module = host.load(wasm, limits=limits)
            except StateFileError as cached:
                if not cached.missing and "does not exist" not in cached.message:
                    _log.warning(
                        "cached module refused; fetching it again",
                        extra={"fields": {"tenant": tenant.name, "error": cached.message}},
                    )
                if not fetch:
                    raise
                module = self._fetch(sha256, limits, registry)
            evaluator = Evaluator(name=name, owner=tenant.name, module=module)
            registry.check_loaded(tenant, name, evaluator)
            self._failed.discard((tenant.name, name, sha256))
        except EvaldError as exc:
            key = (tenant.name, name, sha256)
            if key not in self._failed:
                self._failed.add(key)
                _log.error(
                    "registered module not served",
                    extra={
                        "fields": {
                            "tenant": tenant.name,
                            "evaluator": name[:64],
                            "sha256": sha256[:64],
                            "error": exc.message[:300],
                        }
                    },
                )
            raise
        return evaluator

    def _fetch(self, sha256: str, limits: Limits, registry: FleetRegistry) -> Any:
        host = self._host
        assert host is not None
        if not is_sha256(sha256):
            raise EvaldError(ErrorCode.INVALID_ARGUMENT, "the store's module hash is malformed")
        wasm = self.database.module(sha256)
        if wasm is None:
            raise EvaldError(ErrorCode.UNAVAILABLE, f"the store has no module {sha256[:12]}")
        if hashlib.sha256(wasm).hexdigest() != sha256:
            raise EvaldError(
                ErrorCode.INVALID_MODULE,
                f"the store's module {sha256[:12]} is corrupt: its bytes do not match its hash",
            )
        compiled = registry.compile_upload(wasm, host.memory_cap(limits))
        module = host.adopt(wasm, compiled, limits=limits)
        host.store_compiled(module)
        try:
            self._cache.put_module(wasm)
        except StateFileError as exc:
            _log.warning("module not cached locally", extra={"fields": {"error": exc.message}})
        return module

    # The local cache ------------------------------------------------------------------------

    def _write_cache(self) -> None:
        document = {
            "version": _CACHE_VERSION,
            "revision": self.applied,
            "tenants": [_jsonable(row) for _, row in sorted(self._store_tenants.items())],
            "evaluators": {t: dict(sorted(n.items())) for t, n in sorted(self._wanted.items())},
        }
        try:
            atomic_write(
                self._cache.state_dir / CACHE_FILE,
                (json.dumps(document, indent=1, sort_keys=True) + "\n").encode("utf-8"),
            )
            referenced = {sha for names in self._wanted.values() for sha in names.values()}
            self._cache.collect_garbage(referenced)
        except StateFileError as exc:
            _log.warning("local cache not written", extra={"fields": {"error": exc.message}})

    def _read_cache(self) -> ChangeSet | None:
        path = self._cache.state_dir / CACHE_FILE
        try:
            document: Any = read_json(path, _MAX_CACHE_BYTES, _MAX_CACHE_DEPTH)
            if not isinstance(document, dict) or document.get("version") != _CACHE_VERSION:
                raise StateFileError(f"{CACHE_FILE} is not a cache this daemon wrote")
            tenants = tuple(row for row in document["tenants"] if isinstance(row, dict))
            evaluators = tuple(
                EvaluatorRow(str(tenant), str(name), str(sha256), 0)
                for tenant, names in dict(document["evaluators"]).items()
                for name, sha256 in dict(names).items()
            )
            head = int(document["revision"])
        except StateFileError as exc:
            if not exc.missing:
                _log.error("local cache refused", extra={"fields": {"error": exc.message}})
            return None
        except (KeyError, TypeError, ValueError) as exc:
            _log.error("local cache refused", extra={"fields": {"error": str(exc)[:200]}})
            return None
        return ChangeSet(
            head=head, since=0, full=True, tenants=tenants, evaluators=evaluators, revisions=()
        )


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(json.dumps(row, default=str))
    return document
