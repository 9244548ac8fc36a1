"""The evald daemon: the composition root that wires its parts into one ``EvaldServer``.

The parts, each in its own module:

* :mod:`evald.daemon._admission`: who a call is (tokens, the tokenless unix-socket tenant) and what
  it may hold (evaluations, calls and unread output bytes in flight, rate, batch size);
* :mod:`evald.daemon._scheduler`: the fair scheduler that runs admitted items on the guest workers,
  round-robin across tenants in time slices, no tenant holding more than its ``max_running``;
* :mod:`evald.daemon._service`: ``evald.v1.Evaluator`` over gRPC (``grpc.aio``);
* :mod:`evald.daemon._data_path`: the same evaluations as length-prefixed frames on a unix socket;
* :mod:`evald.daemon._lifecycle`: the gRPC server, binding, signals and draining.

This module holds what ties them together: the host, the registry and its store, the control
thread, the metrics, and :meth:`EvaldServer.run`, the one function the scheduler calls per item.

Threading: the event loop only parses requests, authenticates, resolves evaluators, admits work
against quotas and sends responses. Guest code always runs on the scheduler's worker threads (a
ctypes call into wasmtime releases the GIL, so workers run guests in parallel), so one tenant's
slow evaluation never delays the loop. Changes (tenants, tokens, registrations' commits,
deletions) apply on one control thread and module work (compiling, loading) runs on a module
thread (:mod:`evald.daemon._control_threads`), so a revocation never waits for a compile and
the daemon serves before its store's modules are loaded. Registrations compile one at a time
from a queue shared fairly between tenants (:mod:`evald.daemon._compile_queue`), in a niced,
CPU- and memory-limited worker process (:class:`evald.host.Compiler`), so a compile holds
neither the GIL nor every core.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2

from evald.contract import ErrorCode, pb
from evald.daemon._admission import Admission, Tenant, host_limits
from evald.daemon._compile_queue import CompileQueue
from evald.daemon._config import Config, ConfigError, HostSettings, ServerSettings, TenantConfig
from evald.daemon._control_store import ControlStore
from evald.daemon._control_threads import ControlThreads, Recheck, still_names
from evald.daemon._cpu_affinity import check_cpus, format_cpu_list, pin_process, pinning
from evald.daemon._data_path import DataServer
from evald.daemon._embedded import EmbeddedStore
from evald.daemon._gatekeeping import PROTO_CODES, SERVICE_NAME, error_response
from evald.daemon._lifecycle import bind, grpc_server, run_until_signal
from evald.daemon._logging import configure_logging
from evald.daemon._metrics import Metrics
from evald.daemon._priority import heavy_tenant_priorities
from evald.daemon._registry import Evaluator, Registry
from evald.daemon._scheduler import Scheduler, Work
from evald.daemon._standard_modules import standard_module_paths
from evald.daemon._store import ModuleStore
from evald.daemon._transport import Stoppable
from evald.host import (
    CompiledModule,
    Compiler,
    EvalOutcome,
    HostConfig,
    Limits,
    LoadedModule,
    WasmHost,
)

__all__ = ["SERVICE_NAME", "STORE_HEALTH_SERVICE", "EvaldServer", "host_config", "serve"]

#: The health service that says whether the daemon reaches its store (NOT_SERVING: degraded,
#: it serves what it has).
STORE_HEALTH_SERVICE = "evald.v1.Store"
#: How long a start waits for its store's modules before it serves without them (those still
#: loading then answer ``unavailable``, retry): compiled code from the disk cache loads well
#: within it, a store of modules to compile could take minutes.
START_LOAD_WAIT_S = 1.0
#: An item that waited less than this for a worker keeps its whole deadline: the limits it
#: shares with its tenant's other items are not copied for a wait the guest cannot notice.
WAITED_MS = 2


_log = logging.getLogger("evald.server")


def host_config(host: HostSettings, state_dir: Path | None) -> HostConfig:
    """The wasm host settings the daemon runs with, from the config's ``[host]`` table.

    Shared with ``evald build`` and ``evald test`` (which pass ``state_dir=None``: no disk cache),
    so a module is checked and run there under exactly the daemon's engine settings.
    """
    cache_dir: Path | None = None
    if host.compile_cache and state_dir is not None:
        configured = Path(host.cache_dir).expanduser() if host.cache_dir else None
        cache_dir = configured or state_dir / "cache"
    return HostConfig(
        max_wasm_stack_bytes=host.max_wasm_stack_bytes,
        module_bytes=host.module_bytes,
        epoch_tick_ms=host.epoch_tick_ms,
        isolation=host.isolation,
        cache_dir=cache_dir,
        load_fuel=host.load_fuel,
        load_deadline_ms=host.load_deadline_ms,
        allocator=host.allocator,
        pool_instances=host.pool_instances,
        pool_memory_bytes=host.pool_memory_bytes,
        instances_per_thread=host.instances_per_thread,
    )


class EvaldServer:
    """The daemon: state, host, registry and the gRPC server. Use from one event loop.

    ``await start()`` loads every evaluator and starts listening; ``await stop()`` drains
    in-flight calls (at most ``shutdown_grace_s``) and releases everything. Its transports see
    it through two small interfaces it implements: :class:`~evald.daemon._transport.Core`
    (evaluations, for the gRPC service and the data path alike) and
    :class:`~evald.daemon._service.ControlPlane` (modules, for the gRPC service).
    """

    def __init__(self, config: Config) -> None:
        """Raises ConfigError: a ``[server] cpus`` CPU is not available to the daemon."""
        self.config = config
        settings = config.server
        #: the CPUs evald's work runs on ([server] cpus; empty: not pinned, every CPU it has)
        self.cpus = settings.cpus
        cpus_used = check_cpus(self.cpus, config.source)
        self.listen = settings.resolved_listen
        self.state_dir = settings.resolved_state_dir
        self.threads = settings.resolved_threads
        self.metrics = Metrics()
        self._cpu_list = format_cpu_list(cpus_used)
        self.metrics.cpus.labels(self._cpu_list).set(len(cpus_used))
        self.metrics_port: int | None = None
        self.stopping = False
        self.admission = Admission(config, self.metrics, self.threads)
        self.priorities = heavy_tenant_priorities(settings.heavy_tenant_nice)
        self.scheduler = Scheduler(
            self.run,
            self.threads,
            flush=self.metrics.flush_tally,
            priorities=self.priorities,
            uncharged=self._uncharged_s,
            initializer=pinning(self.cpus),
        )
        # Core's operations that run per call and per item, bound once here: no forwarding
        # call on the evaluation path.
        self.authenticate = self.admission.tenant_for
        self.authenticate_token = self.admission.tenant_for_token
        self.enter = self.admission.enter
        self.enter_unauthenticated = self.admission.enter_unauthenticated
        self.check_batch_size = self.admission.check_batch_size
        self.prepare = self.admission.prepare
        self.drain = self.scheduler.drain
        self.enqueue = self.scheduler.enqueue
        self.abandon = self.scheduler.abandon
        self.watch = self.admission.watch
        self.watch_token = self.admission.watch_token
        self._threads = ControlThreads(pinning(self.cpus))
        self.control = self._threads.control
        self._compile_queue = CompileQueue(
            capacity=settings.compile_queue, per_tenant=settings.compile_queue_per_tenant
        )
        self._compiler = Compiler(
            cpu_s=settings.compile_cpu_s,
            wall_s=settings.compile_timeout_s,
            memory_bytes=settings.compile_memory_bytes,
        )
        self._streams: set[Stoppable] = set()
        self._store: ModuleStore | None = None
        self._host: WasmHost | None = None
        self._registry: Registry | None = None
        self._server: Any = None
        self._health: Any = None
        self._socket_path: Path | None = None
        self._data: DataServer | None = None  # the data path, when [server] data_listen is set
        self._control_store: ControlStore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._health_updates: set[asyncio.Future[Any]] = set()

    # Core and ControlPlane, beyond the operations bound in __init__ ------------------------

    @property
    def settings(self) -> ServerSettings:
        return self.config.server

    def observe_call(self, method: str, tenant: str, code: str) -> None:
        self.metrics.observe_rpc(method, tenant, code)

    def track(self, stream: Stoppable) -> None:
        """Remembers an open stream, so :meth:`stop` wakes it to end."""
        self._streams.add(stream)

    def untrack(self, stream: Stoppable) -> None:
        self._streams.discard(stream)

    def evaluators(self, tenant: Tenant) -> list[Evaluator]:
        return self.registry.visible(tenant.name)

    @property
    def revision(self) -> int:
        return self._registry.revision if self._registry is not None else 0

    # StoreDaemon: what the store does to the daemon (on the control thread) ------------------

    def apply_tenants(self, tenants: Sequence[TenantConfig]) -> None:
        """Serves ``tenants`` from now on: tokens and limits at once, modules of new tenants,
        and the streams and data-path connections of revoked tokens end ``unauthenticated``."""
        before = set(self.admission.tenants)
        ended = self.admission.apply_tenants(tenants)
        limits = {name: state.limits for name, state in self.admission.tenants.items()}
        if self._registry is not None:
            self._registry.set_tenants(tenants, limits)
            self.metrics.count_modules(limits, self._registry.owned_count)
        for name in before - set(limits):
            self.metrics.forget_tenant(name)
        if ended:
            _log.info(
                "calls of revoked tokens ended",
                extra={"fields": {"tenants": sorted(set(ended)), "calls": len(ended)}},
            )

    def limits_of(self, tenant: str) -> Limits:
        state = self.admission.tenants.get(tenant)
        return state.limits if state is not None else host_limits(self.config.default_limits)

    def store_health(self, problem: str | None) -> None:
        """The store became unreachable or reachable again (any thread): the metric, and the
        health service :data:`STORE_HEALTH_SERVICE`."""
        self.metrics.store_connected.set(0 if problem else 1)
        loop, health = self._loop, self._health
        if loop is None or health is None:
            return
        status = (
            health_pb2.HealthCheckResponse.NOT_SERVING
            if problem
            else health_pb2.HealthCheckResponse.SERVING
        )

        def set_status() -> None:
            if not self.stopping:
                task = asyncio.ensure_future(health.set(STORE_HEALTH_SERVICE, status))
                self._health_updates.add(task)
                task.add_done_callback(self._health_updates.discard)

        with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon stopped
            loop.call_soon_threadsafe(set_status)

    async def reload(self) -> bool:
        """Reads the config file again and applies its tenants (``SIGHUP``, ``evald reload``);
        with the fleet store, reads the whole store too. A config that does not parse changes
        nothing (logged). Returns whether it was applied."""
        return await self.control(self._reload)

    def _reload(self) -> bool:
        from evald.daemon._config import load_config

        store = self._control_store
        if store is None or self.stopping:
            return False
        try:
            fresh = load_config(self.config.source)
        except ConfigError as exc:
            _log.error("config not reloaded", extra={"fields": {"error": str(exc)[:500]}})
            return False
        before = {tenant.name: tenant for tenant in self.admission.tenants_configs()}
        store.reload(fresh)
        after = {tenant.name: tenant for tenant in self.admission.tenants_configs()}
        _log.info(
            "config reloaded",
            extra={
                "fields": {
                    "source": fresh.source,
                    "added": sorted(set(after) - set(before)),
                    "removed": sorted(set(before) - set(after)),
                    "changed": sorted(
                        name for name in set(before) & set(after) if before[name] != after[name]
                    ),
                    "revision": self.revision,
                }
            },
        )
        return True

    async def delete(self, tenant: Tenant, name: str, recheck: Recheck) -> Evaluator:
        """Deletes one of the tenant's modules on the control thread while ``recheck`` holds."""

        def commit() -> Evaluator:
            config = still_names(tenant, recheck).config  # the store checks the token again
            return self.registry.delete(config, name, token_sha256=recheck.token_sha256)

        return await self.control(commit)

    @property
    def registry(self) -> Registry:
        assert self._registry is not None, "EvaldServer.start() has not run"
        return self._registry

    @property
    def data_target(self) -> str | None:
        """``unix:PATH`` of the data path while it serves, else None."""
        return self._data.target if self._data is not None else None

    @property
    def host(self) -> WasmHost:
        assert self._host is not None, "EvaldServer.start() has not run"
        return self._host

    def _uncharged_s(self) -> float:
        """The calling worker's CPU time of its last item that was another tenant's doing."""
        host = self._host
        return host.take_uncharged_s() if host is not None else 0.0

    def _expired_in_queue(self, work: Work) -> pb.EvaluateResponse:
        """The answer to an item whose deadline passed while it waited for a worker: nobody
        waits for its value any more, so the guest is not called (its worker is free at once)."""
        work.tenant.release()
        code = ErrorCode.DEADLINE_EXCEEDED
        self.metrics.tally_evaluation(work.tenant.name, work.evaluator.name, code.value, 0, 0)
        return error_response(
            work.request_id,
            code,
            f"the {work.limits.deadline_ms} ms deadline passed while the evaluation waited for "
            "one of evald's workers (all busy); it did not run",
        )

    def run(self, work: Work) -> pb.EvaluateResponse:
        """Runs one admitted evaluation on the calling (worker) thread; never raises. Its metrics
        wait in the thread's tally until its batch's last item or the slice's end
        (``Metrics.flush_tally``)."""
        outcome: EvalOutcome | None = None
        limits = work.limits
        if work.due:
            left_ms = (work.due - time.monotonic()) * 1000
            if left_ms < 1:
                return self._expired_in_queue(work)
            if left_ms < limits.deadline_ms - WAITED_MS:
                limits = dataclasses.replace(limits, deadline_ms=max(1, int(left_ms)))
        try:
            outcome = self.host.evaluate(
                work.evaluator.module, work.data, limits, pool_key=work.tenant.name
            )
        except Exception:
            _log.exception(
                "host failed",
                extra={"fields": {"tenant": work.tenant.name, "evaluator": work.evaluator.name}},
            )
        finally:
            work.tenant.release()
        if outcome is None:
            response = error_response(
                work.request_id, ErrorCode.INTERNAL, "internal error in the wasm host (see log)"
            )
            self.metrics.tally_evaluation(
                work.tenant.name, work.evaluator.name, ErrorCode.INTERNAL.value, 0, 0
            )
            return response
        response = pb.EvaluateResponse(
            id=work.request_id,
            fuel_used=outcome.fuel_used,
            eval_time_us=outcome.elapsed_us,
            semantics_version=work.evaluator.semantics_version,
        )
        if outcome.error is None and outcome.value is not None:
            response.value = outcome.value
            label = "ok"
        else:
            code = outcome.error or ErrorCode.INTERNAL
            response.error.code = PROTO_CODES[code]
            response.error.message = outcome.message
            label = code.value
        self.metrics.tally_evaluation(
            work.tenant.name, work.evaluator.name, label, outcome.elapsed_us, outcome.fuel_used
        )
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "evaluated",
                extra={
                    "fields": {
                        "tenant": work.tenant.name,
                        "evaluator": work.evaluator.name,
                        "outcome": label,
                        "elapsed_us": outcome.elapsed_us,
                        "fuel_used": outcome.fuel_used,
                    }
                },
            )
        return response

    async def register(
        self, tenant: Tenant, wasm: bytes, replace: bool, recheck: Recheck
    ) -> Evaluator:
        """Queues one registration in the tenant's share of the compile queue
        (:mod:`evald.daemon._compile_queue`): it compiles on the module thread, then commits on
        the control thread if the call's token still names the tenant there (``recheck``)."""
        registry = self.registry

        def commit(module: LoadedModule) -> Evaluator:
            assert self._control_store is not None
            self._control_store.catch_up()  # a revocation committed in the store is applied
            config, token = still_names(tenant, recheck).config, recheck.token_sha256
            return registry.commit_upload(config, wasm, module, replace, token_sha256=token)

        async def job() -> Evaluator:
            module = await self._threads.modules(
                registry.prepare_upload, tenant.config, wasm, tenant.limits, replace
            )
            return await self.control(commit, module)

        return await self._compile_queue.submit(tenant.name, job)

    # Lifecycle ------------------------------------------------------------------------------

    def _host_config(self) -> HostConfig:
        return host_config(self.config.host, self.state_dir)

    def _load(self) -> None:
        """Blocking start-up work: lock the state folder, start the host, open the store and
        load every evaluator."""
        host_settings = self._host_config()
        store = ModuleStore(self.state_dir, max_module_bytes=host_settings.module_bytes)
        store.lock()
        self._store = store
        self._host = WasmHost(host_settings)
        compiler = self._compiler

        def compile_upload(wasm: bytes, memory_cap: int) -> CompiledModule:
            return compiler.compile(host_settings, wasm, memory_cap)

        control_store: ControlStore
        if self.config.store.fleet:
            from evald.daemon._fleet import FleetStore  # needs psycopg: only for the fleet

            compiler.warm()  # it compiles what other daemons register: ready before the first

            control_store = FleetStore(self.config, self, store, self._threads.control_pool)
        else:
            control_store = EmbeddedStore(self.config, self, store)
        self._control_store = control_store
        registry = control_store.make_registry(self._host, compile_upload)
        registry.schedule = self._threads.schedule
        registry.on_removed = self.metrics.forget_evaluator
        self._registry = registry
        self.admission.registry = registry
        standard = registry.load_standard(
            standard_module_paths(),
            host_limits(self.config.default_limits),
        )
        counts = control_store.load()
        self.metrics.count_modules(self.admission.tenants, registry.owned_count)
        self.metrics.revision.set_function(lambda: registry.revision)
        _log.info(
            "evaluators loading",
            extra={
                "fields": {
                    "standard": standard,
                    "registered": counts,
                    "store": control_store.kind,
                    "revision": registry.revision,
                }
            },
        )

    async def start(self) -> None:
        """Loads everything and starts serving.

        Raises:
            EvaldError: the state folder is in use, the address is taken or invalid, or TLS files
                cannot be read. Nothing is left running.
        """
        loop = asyncio.get_running_loop()
        self._loop = loop
        settings = self.config.server
        try:
            await loop.run_in_executor(self._threads.control_pool, self._load)
            give_up = time.monotonic() + START_LOAD_WAIT_S  # modules from the disk cache load
            while self.registry.is_loading() and time.monotonic() < give_up:  # in milliseconds
                await asyncio.sleep(0.01)
            server, health = grpc_server(self)
            self._socket_path = bind(server, self.listen, settings)
            await server.start()
            self._server = server
            self._health = health
            if self._socket_path is not None:
                os.chmod(self._socket_path, settings.socket_mode)
            if settings.data_listen:
                self._data = DataServer(self, settings.data_listen)
                self._data.start()
            if settings.metrics_listen:
                self.metrics_port = self.metrics.serve(settings.metrics_listen)
            await health.set("", health_pb2.HealthCheckResponse.SERVING)
            await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
            problem = self._control_store.problem if self._control_store is not None else None
            await health.set(
                STORE_HEALTH_SERVICE,
                health_pb2.HealthCheckResponse.NOT_SERVING
                if problem
                else health_pb2.HealthCheckResponse.SERVING,
            )
        except BaseException:
            await self._release()
            raise
        _log.info(
            "serving",
            extra={
                "fields": {
                    "listen": self.listen,
                    "data_listen": settings.data_listen,
                    "state_dir": str(self.state_dir),
                    "threads": self.threads,
                    "cpus": self._cpu_list,
                    "tenants": sorted(self.admission.tenants),
                    "metrics_port": self.metrics_port,
                    "pid": os.getpid(),
                }
            },
        )

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops accepting calls, lets in-flight ones finish (at most ``grace_s``), releases all."""
        if self.stopping:
            return
        self.stopping = True
        grace = self.config.server.shutdown_grace_s if grace_s is None else grace_s
        _log.info("draining", extra={"fields": {"grace_s": grace}})
        # Registrations waiting to compile end now; one compiling ends shortly before the grace
        # period does, so its caller still gets a typed answer before its call is cut.
        self._compile_queue.close(
            "the daemon is shutting down; the module was not compiled (register it again "
            "once the daemon is back)"
        )
        cut_off_s = grace - min(1.0, grace / 4)
        self._compiler.stop(cut_off_s)
        self._threads.cut_off_after(cut_off_s + min(0.25, (grace - cut_off_s) / 2))
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        for stream in list(self._streams):
            stream.wake_to_stop()
        data, self._data = self._data, None
        data_stopped = (
            asyncio.get_running_loop().run_in_executor(None, data.stop, grace)
            if data is not None
            else None
        )
        if self._server is not None:
            await self._server.stop(grace)
        if data_stopped is not None:
            await data_stopped
        await self._release()
        _log.info("stopped")

    async def _release(self) -> None:
        loop = asyncio.get_running_loop()
        control_store, self._control_store = self._control_store, None
        if control_store is not None:  # its follower submits to the control thread: first
            await loop.run_in_executor(None, control_store.close)
        if self._data is not None:  # start() failed after the data path started
            await loop.run_in_executor(None, self._data.stop, 0.0)
            self._data = None
        self.scheduler.close_scheduler()
        await loop.run_in_executor(None, self.scheduler.pool.shutdown, True)
        if self.priorities is not None:
            self.priorities.close()
        await loop.run_in_executor(None, self._compiler.close)  # ends the module thread's compile
        await loop.run_in_executor(None, self._threads.close)
        self.metrics.close()
        if self._host is not None:
            self._host.close()
            self._host = None
        if self._socket_path is not None:
            self._socket_path.unlink(missing_ok=True)
            self._socket_path = None
        if self._store is not None:
            self._store.unlock()
            self._store = None


def serve(config: Config) -> None:
    """Runs the daemon until SIGTERM or SIGINT, then drains and returns.

    Raises:
        EvaldError: start-up failed (the message says why: address taken, state folder in use …).
        ConfigError: a ``[server] cpus`` CPU is not available to the daemon.
    """
    configure_logging(config.server.log_level)
    server = EvaldServer(config)
    pin_process(server.cpus)  # a process of its own: all of it, and all it starts, inherits
    asyncio.run(run_until_signal(server))
