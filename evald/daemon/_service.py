"""The gRPC face of the daemon: the ``evald.v1.Evaluator`` servicer and how it is registered.

Why apart: this is the only module that knows gRPC messages, contexts and statuses. A call is
authenticated and admitted (:mod:`evald.daemon._admission`), its items run on the fair scheduler
(:mod:`evald.daemon._scheduler`), and here the results become responses: a failed evaluation is data
(``EvaluateResponse.error``), a failed call (authentication, a malformed request, a refused
registration) is a gRPC status plus the trailing metadata ``evald-error-code``, aborted in one
place (:meth:`_Service._call`).

Requests are parsed by lenient deserializers (:func:`_lenient`): grpc answers a deserializer
that raises with an untyped ``UNKNOWN``, so a malformed message becomes a :class:`_Malformed`
that the handler refuses with ``invalid_argument``. Every response fits ``max_message_bytes``
(:class:`~evald.daemon._gatekeeping.ResponseBudget`), and a stream's unread output is bounded in
bytes per stream and per tenant (docs/daemon.md, "What a caller can make the daemon hold").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
from google.protobuf.message import DecodeError, Message

from evald.contract import ERROR_CODE_METADATA_KEY, ErrorCode, EvaldError, pb, pb_grpc
from evald.daemon._admission import _TenantState
from evald.daemon._gatekeeping import (
    PROTO_CODES,
    SERVICE_NAME,
    ResponseBudget,
    pack_responses,
    reservation,
)
from evald.daemon._registry import Evaluator
from evald.daemon._scheduler import _Work

if TYPE_CHECKING:
    from evald.daemon._server import EvaldServer

__all__ = ["add_service"]

_log = logging.getLogger("evald.server")
_T = TypeVar("_T")


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
        literals=dict(getattr(manifest, "literals", {})),
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
        self._max_message_bytes = daemon.config.server.max_message_bytes

    def _response_budget(self) -> ResponseBudget:
        """A fresh value budget for one response message (``max_message_bytes``)."""
        return ResponseBudget(self._max_message_bytes)

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
            return self._response_budget().fit(result[0])

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

            budget = self._response_budget()
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


def add_service(daemon: EvaldServer, server: Any) -> None:
    """Serves ``evald.v1.Evaluator`` for ``daemon`` on ``server``: as the generated
    ``add_EvaluatorServicer_to_server`` registers it, but with lenient deserializers, so a
    malformed message gets ``invalid_argument``."""
    service = _Service(daemon)

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
