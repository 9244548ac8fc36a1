"""The fleet store as one daemon sees it: following PostgreSQL, and a local cache for when it is
down.

Why this shape: every daemon of a fleet must serve the same tenants, tokens, limits and modules,
change for change, without a restart, and keep serving when the store is away. So:

* the store's revision is the truth and ``LISTEN/NOTIFY`` only the prompt. A follower thread
  listens on :data:`~evald.daemon._store_schema.CHANNEL`; on a notification (a burst of them
  is one read, at most one per :data:`_MIN_READ_INTERVAL_S`: any login of the database can
  notify, and payloads are ignored), and every ``poll_s`` besides, the daemon reads what
  changed since the revision it applied (:meth:`~evald.daemon._postgres.Database.changes`, one
  snapshot) and applies it. After any
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

The store's revision only grows: a read that finds it below the revision applied is an alarm
(logged, store health NOT_SERVING), never followed backwards. A tenant row that does not
convert, or that would take over a config tenant's token, costs only its own tenant
(:mod:`evald.daemon._fleet_tenants`). The follower stops only when told to (:meth:`close`);
anything else it meets is logged and retried, and should it end anyway the store's health says
so. Each successful read confirms that the daemon is current; its age bounds how long a
revoked token can outlive an outage (:mod:`evald.daemon._fleet_status`).

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

import psycopg
import psycopg_pool

from evald.contract import ErrorCode, EvaldError
from evald.daemon._background_loads import BackgroundLoads, LoadKey
from evald.daemon._config import Config, TenantConfig
from evald.daemon._control_store import StoreDaemon
from evald.daemon._fleet_registry import FleetRegistry
from evald.daemon._fleet_status import REWOUND, STOPPED, UNREACHABLE, FleetStatus
from evald.daemon._fleet_tenants import Refusal, log_refusals, store_tenants
from evald.daemon._postgres import ChangeSet, Database, EvaluatorRow
from evald.daemon._registry import Evaluator
from evald.daemon._state_files import StateFileError, atomic_write, read_json
from evald.daemon._store import ModuleStore, is_sha256
from evald.daemon._store_schema import describe_error
from evald.host import CompiledModule, Limits, WasmHost

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
#: Notifications coalesce: at most one read per this many seconds however many arrive.
_MIN_READ_INTERVAL_S: Final = 0.05


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
        self.status = FleetStatus(
            daemon.store_health, daemon.metrics.registry, config.store.max_stale_s
        )
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
        self._refusals_logged: set[Refusal] = set()
        self._cache_current = False  # fleet.json holds the applied revision

    @property
    def problem(self) -> str | None:
        """Why the store's health is NOT_SERVING (None: it is SERVING)."""
        return self.status.problem

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
            status=self.status,
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
        except Exception as exc:  # unreachable, or anything else: the cache, then the follower
            reason = exc.message if isinstance(exc, EvaldError) else _unexpected(exc)
            if not isinstance(exc, EvaldError):
                _log.exception("fleet store not read at start")
            self._unreachable(reason)
            cached = self._read_cache()
            if cached is not None:
                _log.warning(
                    "fleet store unreachable at start: serving the local cache",
                    extra={"fields": {"revision": cached.head, "error": reason}},
                )
                self._apply(cached, fetch=False)
                self.status.confirmed_ago(self._cache_age())
            else:
                _log.warning(
                    "fleet store unreachable at start and no local cache: serving the "
                    "config's tenants only",
                    extra={"fields": {"error": reason}},
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
        after a lost connection or any failure, retry with backoff and read everything. It
        ends only when told to; should it end otherwise, the store's health says so."""
        backoff = 0.1
        try:
            while not self._stop.is_set():
                try:
                    self._listen_and_follow()
                    backoff = 0.1
                except EvaldError as exc:
                    if not self._stop.is_set():
                        self._unreachable(exc.message)
                except Exception as exc:  # psycopg's on a broken connection, or a fault
                    if self._stop.is_set():  # the stop is the event, whatever was raised
                        return
                    if not _is_connection_error(exc):
                        _log.exception("fleet store follower failed; retrying")
                    self._unreachable(_unexpected(exc, self.database.password))
                self._stop.wait(backoff)
                backoff = min(_BACKOFF_MAX_S, backoff * 2)
        finally:
            if not self._stop.is_set():
                _log.error("fleet store follower stopped: changes are no longer applied")
                self.status.set(
                    STOPPED, "the fleet store's follower stopped: changes are no longer applied"
                )

    def _listen_and_follow(self) -> None:
        """One connection's life: listen, read everything, then each burst of notifications
        (coalesced) and every poll interval, until the connection fails or a stop."""
        conn = self.database.listen()  # listening first: nothing committed after is missed
        try:
            self._on_control(lambda: self.sync(full=True))
            self._reachable()
            poll_s = self._poll_interval()
            next_poll = time.monotonic() + poll_s
            last_read = 0.0
            while not self._stop.is_set():
                notified = any(True for _ in conn.notifies(timeout=_WAKE_S, stop_after=1))
                if notified:  # the rest of the burst, without waiting: one read for all
                    pause = last_read + _MIN_READ_INTERVAL_S - time.monotonic()
                    if pause > 0:
                        self._stop.wait(pause)
                    for _ in conn.notifies(timeout=0.001):
                        pass
                if notified or time.monotonic() >= next_poll:
                    last_read = time.monotonic()
                    self._on_control(lambda: self.sync(full=False))
                    next_poll = time.monotonic() + poll_s
        finally:
            try:
                conn.close()
            except Exception:
                pass

    def _poll_interval(self) -> float:
        """``poll_s``, or less where ``max_stale_s`` needs the daemon to confirm more often."""
        poll_s = self._config.store.poll_s
        bound = self._config.store.max_stale_s
        return min(poll_s, bound / 3) if bound > 0 else poll_s

    def _on_control(self, function: Callable[[], None]) -> None:
        """Runs ``function`` on the control thread; nothing once told to stop (the loops
        then see the event and end)."""
        if not self._stop.is_set():
            self._control.submit(function).result()

    def _unreachable(self, reason: str) -> None:
        if not self.status.holds(UNREACHABLE):
            _log.warning("fleet store unreachable", extra={"fields": {"error": reason}})
        self.status.set(UNREACHABLE, f"the fleet store is unreachable: {reason}")

    def _reachable(self) -> None:
        if self.status.holds(UNREACHABLE):
            _log.info("fleet store reachable again", extra={"fields": {"revision": self.applied}})
        self.status.set(UNREACHABLE, None)
        self.status.set(STOPPED, None)

    def sync(self, *, full: bool) -> None:
        """Reads what changed since the applied revision (everything when ``full``) and
        applies it. Run on the control thread. A store whose revision is below the applied
        one is an alarm: nothing is applied, and the daemon stays unconfirmed.

        Raises:
            EvaldError: ``unavailable`` (the store is unreachable).
        """
        started = time.monotonic()
        self.status.reads.inc()
        changes = self.database.changes(self.applied, full=full)
        if changes.head < self.applied:
            self._rewound(changes.head)
            return
        if self.status.holds(REWOUND):
            _log.warning(
                "fleet store revision caught up again", extra={"fields": {"head": changes.head}}
            )
            self.status.set(REWOUND, None)
        if full or changes.head > self.applied:
            self._apply(changes, fetch=True)
        self.status.confirm(started)
        self._touch_cache()

    def _rewound(self, head: int) -> None:
        message = (
            f"the fleet store's revision {head} is below the revision {self.applied} this "
            "daemon applied: the store was rewound (restored from a backup, or written outside "
            "evald); this daemon keeps serving revision "
            f"{self.applied} and applies nothing older (if the store was restored on purpose, "
            f"restart the daemons with their state folder's {CACHE_FILE} removed)"
        )
        if not self.status.holds(REWOUND):
            _log.error(
                "fleet store revision went back",
                extra={"fields": {"head": head, "applied": self.applied}},
            )
        self.status.set(REWOUND, message)

    # Applying -------------------------------------------------------------------------------

    def _apply(self, changes: ChangeSet, *, fetch: bool) -> None:
        registry = self._require_registry()
        if changes.full:
            self._store_tenants = {}
            self._wanted = {}
        for row in changes.tenants:
            self._store_tenants[str(row["name"])] = row
        for name, reason in changes.refused:
            self._store_tenants.pop(name, None)
            log_refusals([Refusal(name, reason)], self._refusals_logged)
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
        self.applied = changes.head  # never below it: a rewound read stops in sync()
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
        """The config's own tenants and the store's that may be served beside them, to the
        daemon; a refused store row is dropped (logged once: :mod:`_fleet_tenants`)."""
        result = store_tenants(
            self._local.values(), self._store_tenants, self._config.default_limits
        )
        for refusal in result.refused:  # a full read (each reload) brings it back to judge
            self._store_tenants.pop(refusal.tenant, None)
        log_refusals(result.refused, self._refusals_logged)
        self._daemon.apply_tenants(list(result.served.values()))

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
        self._cache_current = False
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
            self._cache_current = True
            referenced = {sha for names in self._wanted.values() for sha in names.values()}
            self._cache.collect_garbage(referenced)
        except StateFileError as exc:
            _log.warning("local cache not written", extra={"fields": {"error": exc.message}})

    def _touch_cache(self) -> None:
        """The cache's time says when what it holds was last confirmed current (a restart
        from it starts that old: ``max_stale_s`` counts from then)."""
        if self._cache_current:
            try:
                os.utime(self._cache.state_dir / CACHE_FILE)
            except OSError:
                self._cache_current = False

    def _cache_age(self) -> float:
        try:
            return time.time() - (self._cache.state_dir / CACHE_FILE).stat().st_mtime
        except OSError:
            return float("inf")

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


def _is_connection_error(exc: BaseException) -> bool:
    return isinstance(exc, psycopg.Error | psycopg_pool.PoolTimeout)


def _unexpected(exc: BaseException, password: str | None = None) -> str:
    """An exception in one line for the log and the health message."""
    if _is_connection_error(exc):
        return describe_error(exc, password)
    if isinstance(exc, RecursionError):
        return "RecursionError: a value nested too deep"
    return f"{type(exc).__name__}: {describe_error(exc, password)}"
