"""Every gRPC call passes here first: who it is, which pool it counts in, and how its request
is read.

Why one gate for every service: the daemon serves ``evald.v1.Evaluator`` and reflection (for
tenants) and health (for anyone: probes carry no token) on one gRPC server, and a limit that
only the evaluator service applied was a limit an anonymous caller could walk around: 1,024
health ``Watch`` streams once filled gRPC's own call cap, and every tenant's ``Evaluate`` then got
gRPC's untyped ``RESOURCE_EXHAUSTED``. So the :class:`Gatekeeper` interceptor, which sees every
call when its headers have arrived and before any message is read, decides for all of them:

* a call to a tenant service without a valid token is refused from its metadata, by a handler
  that never reads a message (an unauthenticated caller costs its headers);
* a tenant's call counts against its ``max_calls`` and its share of ``max_concurrent_rpcs``
  (:meth:`Core.enter`), a call to a service that needs no token against ``open_calls``
  (:meth:`Core.enter_unauthenticated`; a health ``Watch`` stream in at most half of them, so
  probes' ``Check`` calls still get through a flood of streams): neither can take the other's
  room, and a refusal is typed (``evald-error-code``), never gRPC's own ``RESOURCE_EXHAUSTED``
  (gRPC's call cap is off);
* a method whose request is one message is served as a client-streaming one, so the daemon
  asks for that message itself: it must arrive whole within ``frame_timeout_s`` of the call's
  start (gRPC would otherwise hold a half-sent message for as long as the client likes), and a
  request to a service that needs no token may be at most ``open_request_bytes``.

The call's slot is released when its handler returns; a handler that must release it before
its status goes out (a stream whose client stopped reading may never take the status) calls
:func:`release_call_slot` itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import grpc
from grpc_reflection.v1alpha import reflection

from evald.contract import ERROR_CODE_METADATA_KEY, ErrorCode, EvaldError
from evald.daemon._gatekeeping import SERVICE_NAME
from evald.daemon._transport import Core

__all__ = ["Gatekeeper", "refusal", "release_call_slot"]

#: Labels a call with no tenant in ``evald_rpcs``.
_NO_TENANT: Final = "unauthenticated"

_call_slot: contextvars.ContextVar[Callable[[], None]] = contextvars.ContextVar("evald_call_slot")


def _nothing() -> None:
    pass


def release_call_slot() -> None:
    """Releases the current call's slot now (idempotent; the gate releases it anyway when the
    handler returns)."""
    _call_slot.get(_nothing)()


class _TooLarge:
    """A request to a service that needs no token over ``open_request_bytes`` (not parsed)."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


class Gatekeeper(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The interceptor that authenticates, counts and bounds every gRPC call (see the module).

    Authenticated calls pass to the service, which authenticates again with the peer in hand
    (the tokenless tenant needs the unix socket).
    """

    def __init__(self, core: Core, *, over_unix: bool) -> None:
        self._core = core
        self._over_unix = over_unix
        settings = core.settings
        self._frame_timeout_s = settings.frame_timeout_s
        self._open_request_bytes = settings.open_request_bytes
        # Reflection is a stream of requests of any size: only for callers with a token (or the
        # tokenless tenant on the socket). Health stays open (probes carry no token).
        self._tenant_services = (f"/{SERVICE_NAME}/", f"/{reflection.SERVICE_NAME}/")

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        handler_call_details: Any,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED, nothing is read
            return None
        method = str(handler_call_details.method)
        label = _NO_TENANT
        try:
            if method.startswith(self._tenant_services):
                tenant = self._core.authenticate(
                    handler_call_details.invocation_metadata, over_unix=self._over_unix
                )
                label = tenant.name
                leave = self._core.enter(tenant, "grpc")
                limit: int | None = None
            else:
                leave = self._core.enter_unauthenticated(
                    "grpc", stream=handler.response_streaming
                )
                limit = self._open_request_bytes
        except EvaldError as exc:
            self._core.observe_call(method.rpartition("/")[2], label, exc.code.value)
            return refusal(exc)
        return self._guarded(handler, leave, limit, method.rpartition("/")[2], label)

    def _guarded(
        self, handler: Any, leave: Callable[[], None], limit: int | None, name: str, label: str
    ) -> Any:
        """``handler`` with its slot released at its end and, for a one-message request, the
        request read here within ``frame_timeout_s`` (and ``limit`` bytes)."""
        if handler.request_streaming:
            behaviour = handler.stream_stream or handler.stream_unary

            async def streaming(requests: AsyncIterator[Any], context: Any) -> Any:
                _call_slot.set(leave)
                try:
                    return await _finish(behaviour(requests, context), context)
                finally:
                    leave()

            if handler.response_streaming:
                return grpc.stream_stream_rpc_method_handler(
                    streaming, handler.request_deserializer, handler.response_serializer
                )
            return grpc.stream_unary_rpc_method_handler(
                streaming, handler.request_deserializer, handler.response_serializer
            )

        behaviour = handler.unary_stream or handler.unary_unary

        async def one_request(_requests: AsyncIterator[Any], context: Any) -> Any:
            _call_slot.set(leave)
            try:
                try:
                    request = await self._read_one(context, limit)
                except EvaldError as exc:
                    self._core.observe_call(name, label, exc.code.value)
                    await _abort(context, exc)
                return await _finish(behaviour(request, context), context)
            finally:
                leave()

        deserializer = _bounded(handler.request_deserializer, limit)
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                one_request, deserializer, handler.response_serializer
            )
        return grpc.stream_unary_rpc_method_handler(
            one_request, deserializer, handler.response_serializer
        )

    async def _read_one(self, context: Any, limit: int | None) -> Any:
        """The call's one request message.

        Raises:
            EvaldError: ``quota_exceeded`` when it does not arrive whole within
                ``frame_timeout_s``; ``invalid_argument`` when there is none, or it is over
                ``limit`` bytes.
        """
        # Not asyncio.wait_for: the read is dropped, not awaited, when it takes too long.
        reading = asyncio.ensure_future(context.read())
        done, _ = await asyncio.wait((reading,), timeout=self._frame_timeout_s)
        if not done:
            reading.add_done_callback(_ignore_result)
            reading.cancel()
            raise EvaldError(
                ErrorCode.QUOTA_EXCEEDED,
                f"the request did not arrive whole within {self._frame_timeout_s:g} s "
                "(frame_timeout_s); send a message at once, or smaller ones",
            )
        request = reading.result()
        if request is grpc.aio.EOF:
            raise EvaldError(ErrorCode.INVALID_ARGUMENT, "the call carried no request message")
        if isinstance(request, _TooLarge):
            raise EvaldError(
                ErrorCode.INVALID_ARGUMENT,
                f"a request of {request.size} bytes; this service reads at most {limit} "
                "(open_request_bytes)",
            )
        return request


def _bounded(deserializer: Any, limit: int | None) -> Any:
    if limit is None or deserializer is None:
        return deserializer

    def parse(data: bytes) -> Any:
        if len(data) > limit:
            return _TooLarge(len(data))
        return deserializer(data)

    return parse


async def _finish(result: Any, context: Any) -> Any:
    """Runs a handler's behaviour: a coroutine (its value is the response, or it wrote its
    responses itself), or an async generator whose responses are written here."""
    if inspect.isasyncgen(result):
        async for response in result:
            await context.write(response)
        return None
    return await result


def _ignore_result(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _abort(context: Any, error: EvaldError) -> Any:
    await context.abort(
        error.code.grpc_status,
        error.message,
        trailing_metadata=((ERROR_CODE_METADATA_KEY, error.code.value),),
    )


def refusal(error: EvaldError) -> Any:
    """A handler that fails the call with ``error`` without reading a single request message."""

    async def refuse(_requests: AsyncIterator[Any], context: Any) -> None:
        await _abort(context, error)

    # No deserializer: nothing is parsed, and the handler never asks for a message.
    return grpc.stream_stream_rpc_method_handler(refuse)
