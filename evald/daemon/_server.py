"""The evald daemon: ``evald.v1.Evaluator`` over gRPC (``grpc.aio``), plus health and reflection.

Threading: the event loop only parses requests, authenticates, resolves evaluators, admits work
against quotas and sends responses. Guest code always runs on a pool of worker threads (a ctypes
call into wasmtime releases the GIL, so workers run guests in parallel), so one tenant's slow
evaluation never delays the loop. Admitted items wait in their tenant's queue; a free worker takes
the next tenant round-robin and runs its items for one time slice, then moves on to the next
tenant, so a large batch costs a handful of thread hand-offs rather than one per item, and no
tenant holds more than its ``max_running`` workers at once: one tenant's slow work cannot take
every worker from the others.
Registration and deletion (fsync) run on a separate single control thread, so they never take
a worker from evaluations; validating and compiling an upload runs in a niced, CPU-limited worker
process (:mod:`evald.host._compiler`), so it holds neither the GIL nor every core.

Before anything is read: the gatekeeper interceptor refuses a call without a valid token from its
metadata, with a handler that never reads the body. After: calls per tenant and in total are
bounded, stream output is bounded in bytes per stream and per tenant, and every response fits a
byte budget with a typed error for each item past it (docs/daemon.md, "What a caller can make the
daemon hold").

Errors: a failed evaluation is data (``EvaluateResponse.error``); a failed call (authentication,
a malformed request, a refused registration) is a gRPC status plus the trailing metadata
``evald-error-code``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from evald.contract import ERROR_CODE_METADATA_KEY, ErrorCode, EvaldError, pb, pb_grpc
from evald.daemon import _sdnotify
from evald.daemon._config import Config, HostSettings, TenantConfig, TenantLimits
from evald.daemon._data_path import DataServer
from evald.daemon._gatekeeping import (
    PROTO_CODES,
    SERVICE_NAME,
    Gatekeeper,
    ResponseBudget,
    error_response,
    pack_responses,
    receive_limit,
    reservation,
    send_limit,
)
from evald.daemon._logging import configure_logging
from evald.daemon._metrics import UNKNOWN_EVALUATOR_LABEL, Metrics
from evald.daemon._registry import Evaluator, Registry
from evald.daemon._store import ModuleStore
from evald.host import CompiledModule, Compiler, EvalOutcome, HostConfig, Limits, WasmHost
from evaluators_wasm import STANDARD_EVALUATORS, wasm_path

__all__ = ["SERVICE_NAME", "EvaldServer", "serve"]


_log = logging.getLogger("evald.server")
_T = TypeVar("_T")

#: A batch job returns its worker to the pool after this long, so other calls interleave.
_SLICE_S = 0.002
#: Longest unix socket path the kernel accepts (sun_path is 108 bytes with the NUL).
_MAX_UNIX_PATH = 107
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def _host_limits(limits: TenantLimits) -> Limits:
    return Limits(
        fuel=limits.fuel,
        memory_bytes=limits.memory_bytes,
        deadline_ms=limits.deadline_ms,
        input_bytes=limits.input_bytes,
        output_bytes=limits.output_bytes,
    )


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


class _TenantState:
    """A tenant's live state: its config, host limits and quota counters (thread-safe)."""

    def __init__(
        self, config: TenantConfig, metrics: Metrics, threads: int, *, shared: bool = True
    ) -> None:
        self.config = config
        self.name = config.name
        # Scheduling state, guarded by the daemon's scheduler lock (see EvaldServer._dispatch).
        self.running_cap = config.limits.running_cap(threads, shared=shared)
        self.running = 0  # workers this tenant holds
        self.queued = 0  # items queued and not yet counted as taken (never an undercount)
        self.batches: collections.deque[_Batch] = collections.deque()
        self.ready = False  # in the daemon's round-robin queue
        self.limits = _host_limits(config.limits)
        self._by_deadline: dict[int, Limits] = {config.limits.deadline_ms: self.limits}
        self._lock = threading.Lock()
        self._inflight = 0
        # Calls and unread output are shared by the gRPC streams (event loop) and the data
        # path's connections (threads): both guarded by _lock, so one budget holds for both.
        self.calls = 0  # calls in flight: unary calls, open streams and data connections
        self.unread = 0  # output bytes reserved by its streams and data connections
        # Woken (wake()) when unread bytes are freed: its streams and data connections.
        self.sinks: set[UnreadWaiter] = set()
        self._rate = config.limits.rate_per_s
        self._burst = float(config.limits.effective_burst)
        self._tokens = self._burst
        self._refilled = time.monotonic()
        # Read at scrape time: no metric update on the evaluation path.
        metrics.inflight.labels(config.name).set_function(lambda: self._inflight)

    def limits_for(self, requested_deadline_ms: int) -> Limits:
        """Host limits with deadline ``min(requested or tenant limit, tenant limit)``."""
        ceiling = self.config.limits.deadline_ms
        deadline_ms = min(requested_deadline_ms, ceiling) if requested_deadline_ms else ceiling
        limits = self._by_deadline.get(deadline_ms)
        if limits is None:
            limits = dataclasses.replace(self.limits, deadline_ms=deadline_ms)
            self._by_deadline[deadline_ms] = limits
        return limits

    def admit(self) -> str | None:
        """Admits one evaluation, or returns why it is refused (a ``quota_exceeded`` message)."""
        limits = self.config.limits
        with self._lock:
            if self._inflight >= limits.max_concurrency:
                return (
                    f"tenant {self.name!r} already has {self._inflight} evaluations in flight, "
                    f"its max_concurrency; retry when some finish"
                )
            if self._rate > 0:
                now = time.monotonic()
                self._tokens = min(self._burst, self._tokens + (now - self._refilled) * self._rate)
                self._refilled = now
                if self._tokens < 1.0:
                    return (
                        f"tenant {self.name!r} exceeded its rate of {self._rate:g} evaluations/s "
                        f"(burst {self._burst:g}); retry later"
                    )
                self._tokens -= 1.0
            self._inflight += 1
        return None

    def release(self) -> None:
        """Ends one admitted evaluation (called once per admission, from any thread)."""
        with self._lock:
            self._inflight -= 1

    def enter_call(self) -> None:
        """Counts one call in flight (any thread): a unary call, a stream or a data connection.

        Raises:
            EvaldError: ``quota_exceeded`` at the tenant's ``max_calls``.
        """
        limit = self.config.limits.max_calls
        with self._lock:
            if self.calls >= limit:
                raise EvaldError(
                    ErrorCode.QUOTA_EXCEEDED,
                    f"tenant {self.name!r} already has {self.calls} calls in flight (unary "
                    "calls, streams and data-path connections), its max_calls; retry when "
                    "some finish (or send more items per batch or stream)",
                )
            self.calls += 1

    def leave_call(self) -> None:
        with self._lock:
            self.calls -= 1

    def reserve_unread(self, size: int) -> bool:
        """Reserves ``size`` output bytes of the tenant's ``unread_bytes`` (any thread); False
        when they do not fit (a lone reservation always fits, so one large item never waits
        for nothing)."""
        bound = self.config.limits.unread_bytes
        with self._lock:
            if self.unread and self.unread + size > bound:
                return False
            self.unread += size
            return True

    def free_unread(self, size: int) -> None:
        """Returns output bytes to the tenant's budget (any thread) and wakes what waits for
        room: its streams and data connections."""
        if size:
            with self._lock:
                self.unread -= size
                waiters = list(self.sinks)
            for waiter in waiters:
                waiter.wake()

    def add_waiter(self, waiter: UnreadWaiter) -> None:
        with self._lock:
            self.sinks.add(waiter)

    def remove_waiter(self, waiter: UnreadWaiter) -> None:
        with self._lock:
            self.sinks.discard(waiter)


class UnreadWaiter(Protocol):
    """Something that waits for room in its tenant's ``unread_bytes``: a stream or a data
    connection. ``wake`` may be called from any thread."""

    def wake(self) -> None: ...


@dataclasses.dataclass(slots=True)
class _Work:
    """One admitted evaluation waiting for a worker.

    Made once per item on the event loop: a plain slotted class costs about a third of a
    frozen dataclass (whose ``__init__`` goes through ``object.__setattr__`` per field).
    """

    index: int
    request_id: str
    evaluator: Evaluator
    data: bytes
    limits: Limits
    tenant: _TenantState
    reserved: int = 0  # stream output bytes reserved for this item's response


_Deliver = Callable[[_Work, pb.EvaluateResponse], None]


class _Batch:
    """Items of one call being drained by worker jobs; ``done`` resolves when all finished.

    Without a loop (the data path, whose threads wait on nothing) there is no ``done``:
    ``deliver`` alone reports each result.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None,
        queue: collections.deque[_Work],
        deliver: _Deliver,
    ) -> None:
        self.loop = loop
        self.queue = queue
        self.deliver = deliver
        self.done: asyncio.Future[None] | None = (
            loop.create_future() if loop is not None else None
        )
        self._remaining = len(queue)
        self._lock = threading.Lock()
        self.tenant: _TenantState = queue[0].tenant

    def finish(self, work: _Work, response: pb.EvaluateResponse) -> None:
        """Delivers one result (any thread); the last one resolves ``done``."""
        self.deliver(work, response)
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last and self.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone
                self.loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)


class _Sink:
    """Where a stream's workers drop finished results; wakes the sender once per burst.

    Each result travels with the output bytes reserved for it at admission, freed when the
    sender hands the result to gRPC.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._results: list[tuple[pb.EvaluateResponse, int]] = []
        self.event = asyncio.Event()
        self.room = asyncio.Event()
        self.outstanding = 0  # items admitted and not yet sent
        self.reserved = 0  # output bytes reserved for them
        self._loop_thread = threading.get_ident()  # made on the loop's thread

    def wake(self) -> None:
        """Room was freed in the tenant's budget (any thread): the reader looks again."""
        if threading.get_ident() == self._loop_thread:
            self.room.set()
        else:
            with contextlib.suppress(RuntimeError):  # the loop is gone
                self._loop.call_soon_threadsafe(self.room.set)

    def put_threadsafe(self, work: _Work, response: pb.EvaluateResponse) -> None:
        with self._lock:
            self._results.append((response, work.reserved))
            first = len(self._results) == 1
        if first:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
                self._loop.call_soon_threadsafe(self.event.set)

    def put_local(self, responses: Iterable[tuple[pb.EvaluateResponse, int]]) -> None:
        with self._lock:
            self._results.extend(responses)
        self.event.set()

    def take(self) -> list[tuple[pb.EvaluateResponse, int]]:
        with self._lock:
            results, self._results = self._results, []
        return results


def _evaluator_info(evaluator: Evaluator) -> pb.EvaluatorInfo:
    manifest = evaluator.module.manifest
    return pb.EvaluatorInfo(
        name=evaluator.name,
        version=str(manifest.version),
        tag=str(manifest.tag),
        input_grammar=str(manifest.input_grammar),
        result_regex=str(manifest.result_regex),
        semantics_version=str(manifest.semantics_version),
        description=str(manifest.description),
        owner=evaluator.owner,
        sha256=str(evaluator.module.sha256),
        examples=[
            pb.EvaluatorExample(
                input=example["input"],
                value=example["value"],
                question=example.get("question", ""),
            )
            for example in getattr(manifest, "examples", ())
        ],
    )


class _Malformed:
    """A request whose bytes do not parse as the method's message.

    grpc answers a deserializer that raises with an untyped ``UNKNOWN`` status (and a stream
    reader with an exception); the lenient deserializers below return this instead, so the
    handler refuses the call with ``invalid_argument`` like any other bad request.
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(message_type: type[Message]) -> Callable[[bytes], Any]:
    name = message_type.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError:
            return _Malformed(
                f"the request is not a valid {name} message (corrupt protobuf, or a string "
                "field that is not UTF-8); send the evald.v1 messages of proto/evald/v1"
            )

    return parse


class _CallFailed(Exception):
    """Carries a call-level error out of a handler to the one place that aborts the call."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _ignore_result(task: asyncio.Task[Any]) -> None:
    """Retrieves an abandoned task's outcome so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


class _Service(pb_grpc.EvaluatorServicer):
    """``evald.v1.Evaluator``: authenticates every call, then evaluates on worker threads."""

    def __init__(self, daemon: EvaldServer) -> None:
        self._daemon = daemon

    # Plumbing -------------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        context: Any,
        body: Callable[[_TenantState], Awaitable[_T]],
    ) -> _T:
        daemon = self._daemon
        tenant_label = "unauthenticated"
        code = "ok"
        failure: _CallFailed | None = None
        try:
            tenant = daemon.authenticate(context)
            tenant_label = tenant.name
            tenant.enter_call()
            try:
                return await body(tenant)
            finally:
                tenant.leave_call()
        except EvaldError as exc:
            failure = _CallFailed(exc.code, exc.message)
        except asyncio.CancelledError:
            code = "cancelled"
            raise
        except Exception:
            _log.exception("call failed", extra={"fields": {"method": method}})
            failure = _CallFailed(ErrorCode.INTERNAL, "internal error in the daemon (see its log)")
        finally:
            if failure is not None:
                code = failure.code.value
                _log.info(
                    "call refused",
                    extra={
                        "fields": {
                            "method": method,
                            "tenant": tenant_label,
                            "code": code,
                            "error": failure.message,
                            "peer": str(context.peer()),
                        }
                    },
                )
            daemon.metrics.observe_rpc(method, tenant_label, code)
        assert failure is not None
        await context.abort(
            failure.code.grpc_status,
            failure.message,
            trailing_metadata=((ERROR_CODE_METADATA_KEY, failure.code.value),),
        )
        raise AssertionError("context.abort returned")  # pragma: no cover

    # RPCs -----------------------------------------------------------------------------------

    async def Evaluate(self, request: pb.EvaluateRequest, context: Any) -> pb.EvaluateResponse:
        async def body(tenant: _TenantState) -> pb.EvaluateResponse:
            daemon = self._daemon
            prepared = daemon.prepare(tenant, request, 0)
            if isinstance(prepared, pb.EvaluateResponse):
                return prepared
            result: list[pb.EvaluateResponse] = []

            def deliver(_work: _Work, response: pb.EvaluateResponse) -> None:
                result.append(response)

            # Through the tenant's queue like a batch item, so it counts against max_running.
            await daemon.drain(collections.deque((prepared,)), deliver)
            if daemon.stopping and result[0].error.code == PROTO_CODES[ErrorCode.UNAVAILABLE]:
                raise EvaldError(ErrorCode.UNAVAILABLE, "the daemon is shutting down")
            return daemon.response_budget().fit(result[0])

        return await self._call("Evaluate", context, body)

    async def EvaluateBatch(
        self, request: pb.EvaluateBatchRequest, context: Any
    ) -> pb.EvaluateBatchResponse:
        async def body(tenant: _TenantState) -> pb.EvaluateBatchResponse:
            daemon = self._daemon
            daemon.check_batch_size(len(request.items))
            results: list[pb.EvaluateResponse | None] = [None] * len(request.items)
            queue: collections.deque[_Work] = collections.deque()
            for index, item in enumerate(request.items):
                prepared = daemon.prepare(tenant, item, index)
                if isinstance(prepared, pb.EvaluateResponse):
                    results[index] = prepared
                else:
                    queue.append(prepared)

            budget = daemon.response_budget()
            for index, refused in enumerate(results):
                if refused is not None:
                    results[index] = budget.fit(refused)

            def deliver(work: _Work, response: pb.EvaluateResponse) -> None:
                # Counted as each finishes, so the daemon never holds more than one response's
                # worth of values for the call.
                results[work.index] = budget.fit(response)

            await daemon.drain(queue, deliver)
            return pb.EvaluateBatchResponse(results=cast("list[pb.EvaluateResponse]", results))

        return await self._call("EvaluateBatch", context, body)

    async def EvaluateStream(
        self, request_iterator: AsyncIterator[pb.EvaluateBatchRequest], context: Any
    ) -> None:
        daemon = self._daemon
        method = "EvaluateStream"
        try:
            tenant = daemon.authenticate(context)
            tenant.enter_call()
        except EvaldError as exc:
            daemon.metrics.observe_rpc(method, "unauthenticated", exc.code.value)
            await context.abort(
                exc.code.grpc_status,
                exc.message,
                trailing_metadata=((ERROR_CODE_METADATA_KEY, exc.code.value),),
            )
            return
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                tenant.leave_call()

        try:
            await self._stream(tenant, request_iterator, context, leave)
        finally:
            leave()

    async def _stream(
        self,
        tenant: _TenantState,
        request_iterator: AsyncIterator[pb.EvaluateBatchRequest],
        context: Any,
        on_end: Callable[[], None],
    ) -> None:
        daemon = self._daemon
        method = "EvaluateStream"
        settings = daemon.config.server
        loop = asyncio.get_running_loop()
        sink = _Sink(loop)
        drains: set[asyncio.Task[None]] = set()
        tenant.add_waiter(sink)

        # Backpressure in bytes: every admitted item reserves the most its response can take
        # (its output cap, its id, an error message) until the response is handed to gRPC. At
        # the stream's or the tenant's bound the daemon stops reading the stream (HTTP/2 flow
        # control then stalls the client), so a client that sends without reading can make the
        # daemon hold at most stream_unread_bytes, and all of a tenant's streams unread_bytes.
        stream_bound = settings.stream_unread_bytes

        def reserve(size: int) -> bool:
            if sink.reserved and sink.reserved + size > stream_bound:
                return False
            if not tenant.reserve_unread(size):
                return False
            sink.reserved += size
            sink.outstanding += 1
            return True

        def start(queue: collections.deque[_Work]) -> None:
            task = loop.create_task(daemon.drain(queue, sink.put_threadsafe))
            drains.add(task)
            task.add_done_callback(drains.discard)

        async def read() -> None:
            async for message in request_iterator:
                if isinstance(message, _Malformed):
                    raise EvaldError(ErrorCode.INVALID_ARGUMENT, message.reason)
                daemon.check_batch_size(len(message.items))
                queue: collections.deque[_Work] = collections.deque()
                refused: list[tuple[pb.EvaluateResponse, int]] = []
                for index, item in enumerate(message.items):
                    size = reservation(tenant.limits.output_bytes, item.id)
                    while not reserve(size):
                        if queue:
                            start(queue)
                            queue = collections.deque()
                        if refused:
                            sink.put_local(refused)
                            refused = []
                        sink.room.clear()
                        await sink.room.wait()
                    prepared = daemon.prepare(tenant, item, index)
                    if isinstance(prepared, pb.EvaluateResponse):
                        refused.append((prepared, size))
                    else:
                        prepared.reserved = size
                        queue.append(prepared)
                if refused:
                    sink.put_local(refused)
                if queue:
                    start(queue)

        async def send(results: list[tuple[pb.EvaluateResponse, int]]) -> None:
            for batch, freed in pack_responses(results, settings.max_message_bytes):
                await write(batch, freed)

        async def write(batch: list[pb.EvaluateResponse], freed: int) -> None:
            # Not asyncio.wait_for: it waits without bound for the cancelled write.
            writing = loop.create_task(context.write(pb.EvaluateBatchResponse(results=batch)))
            done, _ = await asyncio.wait((writing,), timeout=settings.stream_stall_s)
            if not done:
                # The pending write would hold the status back until the client reads: drop it
                # (gRPC may have taken part of it; the call ends here either way).
                writing.add_done_callback(_ignore_result)
                writing.cancel()
                await asyncio.wait((writing,), timeout=1.0)
                _log.info(
                    "stream cut off: its client stopped reading",
                    extra={"fields": {"tenant": tenant.name, "unread_bytes": sink.reserved}},
                )
                raise EvaldError(
                    ErrorCode.QUOTA_EXCEEDED,
                    f"the client read no results for {settings.stream_stall_s:g} s while "
                    f"{sink.reserved} bytes of them waited (stream_unread_bytes is "
                    f"{stream_bound}); the stream is ended: read results as they come",
                )
            writing.result()
            sink.outstanding -= len(batch)
            sink.reserved -= freed
            tenant.free_unread(freed)
            sink.room.set()

        reader = loop.create_task(read())
        reader.add_done_callback(lambda _task: sink.event.set())

        def release() -> None:
            """Ends the stream's work and gives its budget back (idempotent)."""
            daemon.unregister_sink(sink)
            tenant.remove_waiter(sink)
            reader.cancel()
            for task in list(drains):
                task.cancel()
            # Whatever was not sent (the call ended or was cancelled) goes back to the tenant.
            tenant.free_unread(sink.reserved)
            sink.reserved = 0
            on_end()

        daemon.register_sink(sink)
        code = "ok"
        try:
            failure: EvaldError | None = None
            try:
                while True:
                    await sink.event.wait()
                    sink.event.clear()
                    results = sink.take()
                    if results:
                        await send(results)
                    if daemon.stopping and not reader.done():
                        reader.cancel()
                    if reader.done() and sink.outstanding <= 0:
                        break
            except EvaldError as exc:  # the client stopped reading
                failure = exc
            if failure is None and not reader.cancelled() and reader.exception() is not None:
                error = reader.exception()
                if isinstance(error, EvaldError):
                    failure = error
                else:
                    _log.error("stream reader failed", exc_info=error)
                    failure = EvaldError(ErrorCode.INTERNAL, "internal error in the daemon")
            elif daemon.stopping:
                failure = EvaldError(
                    ErrorCode.UNAVAILABLE, "the daemon is shutting down; reconnect to another"
                )
            if failure is not None:
                code = failure.code.value
                # Released before the abort: gRPC sends the status only after a message it has
                # started, which a client that stopped reading may never take.
                release()
                await context.abort(
                    failure.code.grpc_status,
                    failure.message,
                    trailing_metadata=((ERROR_CODE_METADATA_KEY, failure.code.value),),
                )
        except asyncio.CancelledError:
            code = "cancelled"
            raise
        finally:
            release()
            daemon.metrics.observe_rpc(method, tenant.name, code)

    async def ListEvaluators(
        self, request: pb.ListEvaluatorsRequest, context: Any
    ) -> pb.ListEvaluatorsResponse:
        async def body(tenant: _TenantState) -> pb.ListEvaluatorsResponse:
            evaluators = self._daemon.registry.visible(tenant.name)
            return pb.ListEvaluatorsResponse(evaluators=[_evaluator_info(ev) for ev in evaluators])

        return await self._call("ListEvaluators", context, body)

    async def RegisterEvaluator(
        self, request: pb.RegisterEvaluatorRequest, context: Any
    ) -> pb.RegisterEvaluatorResponse:
        async def body(tenant: _TenantState) -> pb.RegisterEvaluatorResponse:
            daemon = self._daemon
            if not tenant.config.allow_register:
                raise EvaldError(
                    ErrorCode.PERMISSION_DENIED,
                    f"tenant {tenant.name!r} may not register evaluators "
                    "(set allow_register = true for it in the daemon config)",
                )
            wasm = bytes(request.module)
            evaluator = await daemon.register(tenant, wasm, request.replace)
            daemon.metrics.modules.labels(tenant.name).set(daemon.registry.owned_count(tenant.name))
            _log.info(
                "registered evaluator",
                extra={
                    "fields": {
                        "tenant": tenant.name,
                        "evaluator": evaluator.name,
                        "sha256": evaluator.module.sha256,
                        "bytes": len(wasm),
                        "replace": request.replace,
                    }
                },
            )
            return pb.RegisterEvaluatorResponse(evaluator=_evaluator_info(evaluator))

        return await self._call("RegisterEvaluator", context, body)

    async def DeleteEvaluator(
        self, request: pb.DeleteEvaluatorRequest, context: Any
    ) -> pb.DeleteEvaluatorResponse:
        async def body(tenant: _TenantState) -> pb.DeleteEvaluatorResponse:
            daemon = self._daemon
            evaluator = await daemon.control(daemon.registry.delete, tenant.config, request.name)
            daemon.metrics.modules.labels(tenant.name).set(daemon.registry.owned_count(tenant.name))
            _log.info(
                "deleted evaluator",
                extra={"fields": {"tenant": tenant.name, "evaluator": evaluator.name}},
            )
            return pb.DeleteEvaluatorResponse()

        return await self._call("DeleteEvaluator", context, body)


def _add_service(service: _Service, server: Any) -> None:
    """``evald.v1.Evaluator`` as the generated ``add_EvaluatorServicer_to_server`` registers it,
    but with lenient deserializers: a malformed message gets ``invalid_argument``."""

    def guarded(method: str, handler: Callable[[Any, Any], Awaitable[Any]]) -> Any:
        async def unary(request: Any, context: Any) -> Any:
            if isinstance(request, _Malformed):

                async def refuse(_tenant: _TenantState) -> Any:
                    raise EvaldError(ErrorCode.INVALID_ARGUMENT, request.reason)

                return await service._call(method, context, refuse)
            return await handler(request, context)

        return unary

    unary_methods: dict[str, tuple[Any, type[Message], type[Message]]] = {
        "Evaluate": (service.Evaluate, pb.EvaluateRequest, pb.EvaluateResponse),
        "EvaluateBatch": (service.EvaluateBatch, pb.EvaluateBatchRequest, pb.EvaluateBatchResponse),
        "ListEvaluators": (
            service.ListEvaluators,
            pb.ListEvaluatorsRequest,
            pb.ListEvaluatorsResponse,
        ),
        "RegisterEvaluator": (
            service.RegisterEvaluator,
            pb.RegisterEvaluatorRequest,
            pb.RegisterEvaluatorResponse,
        ),
        "DeleteEvaluator": (
            service.DeleteEvaluator,
            pb.DeleteEvaluatorRequest,
            pb.DeleteEvaluatorResponse,
        ),
    }
    handlers: dict[str, Any] = {
        name: grpc.unary_unary_rpc_method_handler(
            guarded(name, handler),
            request_deserializer=_lenient(request_type),
            response_serializer=response_type.SerializeToString,
        )
        for name, (handler, request_type, response_type) in unary_methods.items()
    }
    handlers["EvaluateStream"] = grpc.stream_stream_rpc_method_handler(
        service.EvaluateStream,
        request_deserializer=_lenient(pb.EvaluateBatchRequest),
        response_serializer=pb.EvaluateBatchResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _add_port(server: Any, address: str, credentials: Any = None) -> int:
    try:
        if credentials is None:
            return int(server.add_insecure_port(address))
        return int(server.add_secure_port(address, credentials))
    except RuntimeError:
        raise EvaldError(
            ErrorCode.UNAVAILABLE,
            f"cannot listen on {address}: the address is in use or not available here",
        ) from None


def _check_unix_socket(path: Path) -> None:
    """Refuses to take over a socket a live daemon serves; removes a stale one (after kill -9)."""
    if len(str(path).encode()) > _MAX_UNIX_PATH:
        raise EvaldError(
            ErrorCode.INVALID_ARGUMENT,
            f"unix socket path is {len(str(path).encode())} bytes, over the kernel's limit of "
            f"{_MAX_UNIX_PATH}: {path}",
        )
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise EvaldError(
            ErrorCode.INVALID_ARGUMENT, f"{path} exists and is not a socket; refusing to replace it"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)  # nobody listens: left over from a daemon that died
        return
    finally:
        probe.close()
    raise EvaldError(
        ErrorCode.UNAVAILABLE,
        f"another daemon is already serving on {path}; stop it or pass a different --listen",
    )


class EvaldServer:
    """The daemon: state, host, registry and the gRPC server. Use from one event loop.

    ``await start()`` loads every evaluator and starts listening; ``await stop()`` drains
    in-flight calls (at most ``shutdown_grace_s``) and releases everything.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        settings = config.server
        self.listen = settings.resolved_listen
        self.state_dir = settings.resolved_state_dir
        self.threads = settings.resolved_threads
        self.metrics = Metrics()
        self.metrics_port: int | None = None
        self.stopping = False
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="evald-guest")
        self._control_pool = ThreadPoolExecutor(1, thread_name_prefix="evald-control")
        self._registrations = 0  # waiting or compiling (event loop only)
        self._compiler = Compiler(
            cpu_s=settings.compile_cpu_s, wall_s=settings.compile_timeout_s
        )
        self._sinks: set[_Sink] = set()
        self._store: ModuleStore | None = None
        self._host: WasmHost | None = None
        self._registry: Registry | None = None
        self._server: Any = None
        self._health: Any = None
        self._socket_path: Path | None = None
        self._data: DataServer | None = None  # the data path, when [server] data_listen is set
        self._tenants = {
            tenant.name: _TenantState(
                tenant, self.metrics, self.threads, shared=len(config.tenants) > 1
            )
            for tenant in config.tenants
        }
        # The fair scheduler: tenants with queued work and a free slot under their cap, in
        # round-robin order, and the workers not running a scheduling job.
        self._sched = threading.Lock()
        self._ready: collections.deque[_TenantState] = collections.deque()
        self._free = self.threads
        self._closed = False
        self._tokened = [
            (bytes.fromhex(state.config.token_sha256), state)
            for state in self._tenants.values()
            if not state.config.tokenless
        ]
        self._tokenless = next(
            (state for state in self._tenants.values() if state.config.tokenless), None
        )

    # Accessors used by the service ----------------------------------------------------------

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

    def register_sink(self, sink: _Sink) -> None:
        self._sinks.add(sink)

    def unregister_sink(self, sink: _Sink) -> None:
        self._sinks.discard(sink)

    def authenticate(self, context: Any) -> _TenantState:
        """The tenant a call belongs to.

        A bearer token is hashed and compared in constant time with every tenant's hash; a call
        without one is the tokenless tenant's only when it arrives over the unix socket.

        Raises:
            EvaldError: ``permission_denied`` with what to fix.
        """
        over_unix = str(context.peer()).startswith("unix:")
        return self.tenant_for(context.invocation_metadata(), over_unix=over_unix)

    def tenant_for(self, metadata: Any, *, over_unix: bool) -> _TenantState:
        """:meth:`authenticate` from the call's metadata alone (what an interceptor sees before
        gRPC reads the request body).

        Raises:
            EvaldError: ``permission_denied`` with what to fix.
        """
        authorization: str | None = None
        for key, value in metadata or ():
            if key == "authorization":
                authorization = value if isinstance(value, str) else value.decode("latin-1")
                break
        if authorization is None:
            if self._tokenless is not None and over_unix:
                return self._tokenless
            where = "this unix socket" if self._socket_path else "TCP"
            raise EvaldError(
                ErrorCode.PERMISSION_DENIED,
                f"no token: calls over {where} need `authorization: Bearer TOKEN` metadata "
                "(evald call --token, or $EVALD_TOKEN)",
            )
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise EvaldError(
                ErrorCode.PERMISSION_DENIED,
                "malformed authorization metadata: expected `Bearer TOKEN`",
            )
        digest = hashlib.sha256(token.strip().encode("utf-8")).digest()
        found: _TenantState | None = None
        for expected, state in self._tokened:
            if hmac.compare_digest(digest, expected):
                found = state
        if found is None:
            raise EvaldError(ErrorCode.PERMISSION_DENIED, "the token matches no tenant")
        return found

    def observe_refusal(self, method: str, code: str) -> None:
        """Counts a call the gatekeeper refused before authentication."""
        self.metrics.observe_rpc(method, "unauthenticated", code)

    def response_budget(self) -> ResponseBudget:
        """A fresh value budget for one response message (``max_message_bytes``)."""
        return ResponseBudget(self.config.server.max_message_bytes)

    def check_batch_size(self, items: int) -> None:
        limit = self.config.server.max_batch_items
        if items > limit:
            raise EvaldError(
                ErrorCode.INVALID_ARGUMENT,
                f"a batch carries {items} items, over the daemon's max_batch_items of {limit}; "
                "split it",
            )

    def prepare(
        self, tenant: _TenantState, request: pb.EvaluateRequest, index: int
    ) -> _Work | pb.EvaluateResponse:
        """Resolves and admits one evaluation, or answers it at once with the refusal."""
        try:
            evaluator = self.registry.resolve(tenant.name, request.evaluator)
        except EvaldError as exc:
            self.metrics.observe_evaluation(
                tenant.name, UNKNOWN_EVALUATOR_LABEL, exc.code.value, 0, 0
            )
            return error_response(request.id, exc.code, exc.message)
        refusal = tenant.admit()
        if refusal is not None:
            self.metrics.observe_evaluation(
                tenant.name, evaluator.name, ErrorCode.QUOTA_EXCEEDED.value, 0, 0
            )
            return error_response(request.id, ErrorCode.QUOTA_EXCEEDED, refusal)
        return _Work(
            index=index,
            request_id=request.id,
            evaluator=evaluator,
            data=request.input,
            limits=tenant.limits_for(request.deadline_ms),
            tenant=tenant,
        )

    def run(self, work: _Work) -> pb.EvaluateResponse:
        """Runs one admitted evaluation on the calling (worker) thread; never raises. Its metrics
        wait in the thread's tally until its batch's last item or the slice's end
        (``Metrics.flush_tally``)."""
        outcome: EvalOutcome | None = None
        try:
            outcome = self.host.evaluate(
                work.evaluator.module, work.data, work.limits, pool_key=work.tenant.name
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

    def _next_locked(self) -> _TenantState | None:
        """Takes one worker slot for the next ready tenant (round-robin); scheduler lock held."""
        ready = self._ready
        while ready:
            tenant = ready.popleft()
            tenant.ready = False
            if tenant.queued <= 0 or tenant.running >= tenant.running_cap:
                continue
            tenant.running += 1
            # Another worker only for items the tenant's running workers will not get to.
            if tenant.running < tenant.running_cap and tenant.queued > tenant.running:
                ready.append(tenant)
                tenant.ready = True
            return tenant
        return None

    def _dispatch_locked(self) -> None:
        """Starts a worker job for each ready tenant while workers are free; lock held."""
        while self._free > 0 and self._ready:
            tenant = self._next_locked()
            if tenant is None:
                return
            try:
                self.pool.submit(self._worker, tenant)
            except RuntimeError:  # the pool is shut down: drain() answers what is left
                tenant.running -= 1
                self._closed = True
                return
            self._free -= 1

    def _slice(self, tenant: _TenantState) -> int:
        """Runs the tenant's queued items for one time slice; returns how many it took."""
        end = time.monotonic() + _SLICE_S
        taken = 0
        batches = tenant.batches
        while True:
            try:
                batch = batches[0]
            except IndexError:
                return taken
            try:
                work = batch.queue.popleft()
            except IndexError:
                with self._sched:
                    if batches and batches[0] is batch:
                        batches.popleft()
                continue
            taken += 1
            response = self.run(work)
            if not batch.queue:  # a batch's last item: its caller may read the metrics next
                self.metrics.flush_tally()
            batch.finish(work, response)
            if time.monotonic() >= end:
                return taken

    def _worker(self, tenant: _TenantState | None) -> None:
        """A scheduling job: runs one slice for a tenant, gives the slot back and takes the
        next ready tenant, until none is ready; the lock is taken once per slice, not per
        item."""
        while tenant is not None:
            taken = 0
            try:
                taken = self._slice(tenant)
            finally:
                self.metrics.flush_tally()
                with self._sched:
                    tenant.queued -= taken
                    tenant.running -= 1
                    batches = tenant.batches
                    while batches and not batches[0].queue:  # finished: let it go
                        batches.popleft()
                    if (
                        tenant.queued > 0
                        and not tenant.ready
                        and tenant.running < tenant.running_cap
                    ):
                        self._ready.append(tenant)  # behind the others: round-robin
                        tenant.ready = True
                    tenant = self._next_locked()
                    if tenant is None:
                        self._free += 1
                    self._dispatch_locked()

    async def drain(self, queue: collections.deque[_Work], deliver: _Deliver) -> None:
        """Runs every queued evaluation on the workers and returns when all have finished.

        ``deliver`` is called on a worker thread as each finishes. When the caller is
        cancelled, items not yet started are answered ``unavailable`` and release their quota.
        """
        if not queue:
            return
        batch = _Batch(asyncio.get_running_loop(), queue, deliver)
        added, scheduled = self.enqueue(batch)
        try:
            if scheduled:
                await cast("asyncio.Future[None]", batch.done)
        finally:
            self.abandon(batch, added)

    def enqueue(self, batch: _Batch) -> tuple[bool, bool]:
        """Puts a batch in its tenant's queue and wakes workers; any thread.

        Returns:
            (added, scheduled): whether the batch was queued, and whether workers will run it;
            a batch that is not scheduled must be answered by :meth:`abandon`.
        """
        tenant = batch.tenant
        with self._sched:
            scheduled = added = not self._closed
            if added:
                tenant.batches.append(batch)
                tenant.queued += len(batch.queue)
                if not tenant.ready and tenant.running < tenant.running_cap:
                    self._ready.append(tenant)
                    tenant.ready = True
                self._dispatch_locked()
                scheduled = not self._closed or tenant.running > 0
        return added, scheduled

    def abandon(self, batch: _Batch, added: bool) -> None:
        """Answers the batch's items no worker has taken ``unavailable`` and releases their
        quota (its caller was cancelled, or the daemon is shutting down); any thread."""
        tenant = batch.tenant
        left = 0
        while True:
            try:
                work = batch.queue.popleft()
            except IndexError:
                break
            left += 1
            work.tenant.release()
            batch.finish(
                work,
                error_response(
                    work.request_id, ErrorCode.UNAVAILABLE, "the daemon is shutting down"
                ),
            )
        if left and added:  # cancelled or shut down: forget the batch
            with self._sched:
                tenant.queued -= left
                with contextlib.suppress(ValueError):
                    tenant.batches.remove(batch)

    def close_scheduler(self) -> None:
        """Stops new batches from being scheduled (before the pool shuts down)."""
        with self._sched:
            self._closed = True

    async def register(self, tenant: _TenantState, wasm: bytes, replace: bool) -> Evaluator:
        """Queues one registration for the control thread (at most ``compile_queue`` wait)."""
        limit = self.config.server.compile_queue
        if self._registrations >= limit:
            raise EvaldError(
                ErrorCode.UNAVAILABLE,
                f"{self._registrations} registrations are already waiting to compile "
                f"(compile_queue is {limit}); retry shortly",
            )
        self._registrations += 1
        try:
            return await self.control(
                self.registry.register, tenant.config, wasm, tenant.limits, replace
            )
        finally:
            self._registrations -= 1

    async def control(self, function: Callable[..., _T], *args: Any) -> _T:
        """Runs a control-plane operation on the control thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._control_pool, function, *args)

    # Lifecycle ------------------------------------------------------------------------------

    def _host_config(self) -> HostConfig:
        return host_config(self.config.host, self.state_dir)

    def _load(self) -> None:
        """Blocking start-up work: lock the store, start the host, load every evaluator."""
        store = ModuleStore(self.state_dir)
        store.lock()
        self._store = store
        host_settings = self._host_config()
        self._host = WasmHost(host_settings)
        compiler = self._compiler

        def compile_upload(wasm: bytes, memory_cap: int) -> CompiledModule:
            return compiler.compile(host_settings, wasm, memory_cap)

        registry = Registry(self._host, store, self.config.tenants, compile=compile_upload)
        standard = registry.load_standard(
            {name: wasm_path(name) for name in STANDARD_EVALUATORS},
            _host_limits(self.config.default_limits),
        )
        counts = registry.load_registered(
            {name: state.limits for name, state in self._tenants.items()}
        )
        self._registry = registry
        for name in self._tenants:
            self.metrics.modules.labels(name).set(registry.owned_count(name))
        _log.info(
            "evaluators loaded",
            extra={"fields": {"standard": standard, "registered": counts}},
        )

    def _bind(self, server: Any) -> None:
        settings = self.config.server
        if self.listen.startswith("unix:"):
            raw = self.listen[len("unix:") :]
            if raw.startswith("//"):  # unix:///abs/path
                raw = raw[2:]
            path = Path(raw).expanduser().absolute()
            _check_unix_socket(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            # Create the socket with the final mode: no window in which others may connect.
            previous = os.umask(0o777 & ~settings.socket_mode)
            try:
                bound = _add_port(server, f"unix:{path}")
            finally:
                os.umask(previous)
            if not bound:
                raise EvaldError(ErrorCode.UNAVAILABLE, f"cannot listen on unix:{path}")
            self._socket_path = path
            return
        host, _, _port = self.listen.rpartition(":")
        if settings.tls_cert:
            try:
                key = Path(settings.tls_key).read_bytes()
                cert = Path(settings.tls_cert).read_bytes()
                ca = Path(settings.tls_client_ca).read_bytes() if settings.tls_client_ca else None
            except OSError as exc:
                raise EvaldError(
                    ErrorCode.INVALID_ARGUMENT, f"cannot read a TLS file: {exc}"
                ) from exc
            credentials = grpc.ssl_server_credentials(
                ((key, cert),), root_certificates=ca, require_client_auth=ca is not None
            )
            bound = _add_port(server, self.listen, credentials)
        else:
            if host not in _LOOPBACK_HOSTS and not settings.allow_insecure_tcp:
                raise EvaldError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"refusing to listen on {self.listen} without TLS: tokens would cross the "
                    "network in clear text. Set tls_cert/tls_key, listen on 127.0.0.1, or set "
                    "allow_insecure_tcp = true",
                )
            bound = _add_port(server, self.listen)
        if not bound:
            raise EvaldError(ErrorCode.UNAVAILABLE, f"cannot listen on {self.listen}")

    async def start(self) -> None:
        """Loads everything and starts serving.

        Raises:
            EvaldError: the state folder is in use, the address is taken or invalid, or TLS files
                cannot be read. Nothing is left running.
        """
        loop = asyncio.get_running_loop()
        settings = self.config.server
        try:
            await loop.run_in_executor(self._control_pool, self._load)
            largest_input = max(
                (tenant.limits.input_bytes for tenant in self.config.tenants),
                default=self.config.default_limits.input_bytes,
            )
            server = grpc.aio.server(
                interceptors=(Gatekeeper(self),),
                options=(
                    (
                        "grpc.max_receive_message_length",
                        receive_limit(
                            settings.max_message_bytes, settings.max_batch_items, largest_input
                        ),
                    ),
                    (
                        "grpc.max_send_message_length",
                        send_limit(settings.max_message_bytes, settings.max_batch_items),
                    ),
                    ("grpc.max_concurrent_streams", settings.max_streams_per_connection),
                    # No flow-control windows grown by bandwidth probing: what a call may have
                    # in flight before the daemon reads it stays at HTTP/2's 64 KiB per stream.
                    ("grpc.http2.bdp_probe", 0),
                    ("grpc.so_reuseport", 0),
                ),
                maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
            )
            _add_service(_Service(self), server)
            health = health_aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
            reflection.enable_server_reflection(
                (
                    SERVICE_NAME,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                ),
                server,
            )
            self._bind(server)
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
                    "tenants": sorted(self._tenants),
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
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        for sink in list(self._sinks):
            sink.event.set()
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
        if self._data is not None:  # start() failed after the data path started
            await loop.run_in_executor(None, self._data.stop, 0.0)
            self._data = None
        self.close_scheduler()
        await loop.run_in_executor(None, self.pool.shutdown, True)
        await loop.run_in_executor(None, self._control_pool.shutdown, True)
        await loop.run_in_executor(None, self._compiler.close)
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


async def _serve_until_signal(config: Config) -> None:
    daemon = EvaldServer(config)
    await daemon.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():  # a second signal: stop draining and leave now
            _log.warning("forced exit", extra={"fields": {"signal": signal.Signals(signum).name}})
            os._exit(1)
        _log.info("signal", extra={"fields": {"signal": signal.Signals(signum).name}})
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    # There is no live reload (config changes need a restart): SIGHUP must not end the daemon,
    # because systemd's Restart=on-failure would not bring back a process killed by it.
    loop.add_signal_handler(
        signal.SIGHUP,
        lambda: _log.warning("SIGHUP ignored: restart the daemon to apply a new config"),
    )
    # Readiness for systemd Type=notify (a no-op outside systemd). The status starts with
    # "serving": the deploy tests check it.
    _sdnotify.notify_ready(f"serving on {daemon.listen}")
    try:
        await stop.wait()
        _sdnotify.notify_stopping("draining")
        await daemon.stop()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)


def serve(config: Config) -> None:
    """Runs the daemon until SIGTERM or SIGINT, then drains and returns.

    Raises:
        EvaldError: start-up failed (the message says why: address taken, state folder in use …).
    """
    configure_logging(config.server.log_level)
    asyncio.run(_serve_until_signal(config))
