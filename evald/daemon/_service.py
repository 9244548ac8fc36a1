"""The gRPC face of the daemon: the ``evald.v1.Evaluator`` servicer and how it is registered.

Why apart: this is the only module that knows gRPC messages, contexts and statuses. A call is
authenticated and admitted (:mod:`evald.daemon._admission`), its items run on the fair scheduler
(:mod:`evald.daemon._scheduler`), and here the results become responses: a failed evaluation is data
(``EvaluateResponse.error``), a failed call (authentication, a malformed request, a refused
registration) is a gRPC status plus the trailing metadata ``evald-error-code``, aborted in one
place (:meth:`_Service._call`).

Requests are parsed by lenient deserializers (:func:`~evald.daemon._gatekeeping.lenient`): grpc
answers a deserializer that raises with an untyped ``UNKNOWN``, so a malformed message becomes a
:class:`~evald.daemon._gatekeeping.Malformed` that the handler refuses with ``invalid_argument``.
Every response fits ``max_message_bytes`` (:class:`~evald.daemon._gatekeeping.ResponseBudget`);
``EvaluateStream`` is :mod:`evald.daemon._grpc_stream`. The servicer sees the daemon as two small
interfaces: :class:`~evald.daemon._transport.Core` (evaluations, as the data path sees them too)
and :class:`ControlPlane` (modules).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar, cast

import grpc
from google.protobuf.message import Message

from evald.contract import (
    ERROR_CODE_METADATA_KEY,
    ErrorCode,
    EvaldError,
    TokenError,
    bearer_token,
    pb,
    pb_grpc,
    token_sha256,
)
from evald.daemon._admission import Tenant
from evald.daemon._control_threads import Recheck
from evald.daemon._gatekeeping import (
    PROTO_CODES,
    SERVICE_NAME,
    Malformed,
    ResponseBudget,
    lenient,
)
from evald.daemon._grpc_gate import release_call_slot
from evald.daemon._grpc_stream import METHOD as STREAM_METHOD
from evald.daemon._grpc_stream import serve_stream
from evald.daemon._registry import Evaluator
from evald.daemon._scheduler import Work
from evald.daemon._transport import Core

__all__ = ["ControlPlane", "add_service"]

_log = logging.getLogger("evald.server")
_T = TypeVar("_T")


class ControlPlane(Protocol):
    """What the gRPC service asks of the daemon beyond evaluations: its modules."""

    @property
    def revision(self) -> int:
        """The revision of tenants and modules the daemon serves now (grows with each change)."""
        ...

    def evaluators(self, tenant: Tenant) -> list[Evaluator]:
        """The evaluators ``tenant`` may call: the standard ones it is allowed, and its own."""
        ...

    async def register(
        self, tenant: Tenant, wasm: bytes, replace: bool, recheck: Recheck
    ) -> Evaluator:
        """Validates, compiles and stores one of ``tenant``'s modules (typed refusals);
        ``recheck`` authenticates the call again when the registration commits."""
        ...

    async def delete(self, tenant: Tenant, name: str, recheck: Recheck) -> Evaluator:
        """Removes one of ``tenant``'s modules (typed refusals); ``recheck`` as for
        :meth:`register`."""
        ...


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
        **manifest.schema_texts(),
    )


class _CallFailed(Exception):
    """Carries a call-level error out of a handler to the one place that aborts the call."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Service(pb_grpc.EvaluatorServicer):
    """``evald.v1.Evaluator``: authenticates every call, then evaluates on worker threads."""

    def __init__(self, core: Core, control: ControlPlane) -> None:
        self._core = core
        self._control = control
        self._max_message_bytes = core.settings.max_message_bytes

    def _tenant_of(self, context: Any) -> Tenant:
        """The call's tenant (the tokenless one only over the unix socket).

        Raises:
            EvaldError: ``permission_denied`` with what to fix.
        """
        return self._recheck(context)()

    def _recheck(self, context: Any) -> Recheck:
        """Authenticates the call's metadata again, from any thread and at any time (a change
        commits only while the call's token still names its tenant), with the token's hash
        for the fleet store to check again in the change's own transaction."""
        over_unix = str(context.peer()).startswith("unix:")
        metadata = tuple(context.invocation_metadata() or ())
        authenticate = self._core.authenticate
        try:
            token = bearer_token(metadata)
        except TokenError:  # malformed: ``authenticate`` refuses it with what to fix
            token = None
        return Recheck(
            lambda: authenticate(metadata, over_unix=over_unix),
            token_sha256(token) if token else None,
        )

    def _response_budget(self) -> ResponseBudget:
        """A fresh value budget for one response message (``max_message_bytes``)."""
        return ResponseBudget(self._max_message_bytes)

    # Plumbing -------------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        context: Any,
        body: Callable[[Tenant], Awaitable[_T]],
    ) -> _T:
        tenant_label = "unauthenticated"
        code = "ok"
        failure: _CallFailed | None = None
        try:
            tenant = self._tenant_of(context)
            tenant_label = tenant.name
            return await body(tenant)
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
            self._core.observe_call(method, tenant_label, code)
        assert failure is not None
        await context.abort(
            failure.code.grpc_status,
            failure.message,
            trailing_metadata=((ERROR_CODE_METADATA_KEY, failure.code.value),),
        )
        raise AssertionError("context.abort returned")  # pragma: no cover

    # RPCs -----------------------------------------------------------------------------------

    async def Evaluate(self, request: pb.EvaluateRequest, context: Any) -> pb.EvaluateResponse:
        async def body(tenant: Tenant) -> pb.EvaluateResponse:
            core = self._core
            prepared = core.prepare(tenant, request, 0)
            if isinstance(prepared, pb.EvaluateResponse):
                return prepared
            result: list[pb.EvaluateResponse] = []

            def deliver(_work: Work, response: pb.EvaluateResponse) -> None:
                result.append(response)

            # Through the tenant's queue like a batch item, so it counts against max_running.
            await core.drain(collections.deque((prepared,)), deliver)
            if core.stopping and result[0].error.code == PROTO_CODES[ErrorCode.UNAVAILABLE]:
                raise EvaldError(ErrorCode.UNAVAILABLE, "the daemon is shutting down")
            return self._response_budget().fit(result[0])

        return await self._call("Evaluate", context, body)

    async def EvaluateBatch(
        self, request: pb.EvaluateBatchRequest, context: Any
    ) -> pb.EvaluateBatchResponse:
        async def body(tenant: Tenant) -> pb.EvaluateBatchResponse:
            core = self._core
            core.check_batch_size(len(request.items))
            results: list[pb.EvaluateResponse | None] = [None] * len(request.items)
            queue: collections.deque[Work] = collections.deque()
            for index, item in enumerate(request.items):
                prepared = core.prepare(tenant, item, index)
                if isinstance(prepared, pb.EvaluateResponse):
                    results[index] = prepared
                else:
                    queue.append(prepared)

            budget = self._response_budget()
            for index, refused in enumerate(results):
                if refused is not None:
                    results[index] = budget.fit(refused)

            def deliver(work: Work, response: pb.EvaluateResponse) -> None:
                # Counted as each finishes, so the daemon never holds more than one response's
                # worth of values for the call.
                results[work.index] = budget.fit(response)

            await core.drain(queue, deliver)
            return pb.EvaluateBatchResponse(results=cast("list[pb.EvaluateResponse]", results))

        return await self._call("EvaluateBatch", context, body)

    async def EvaluateStream(
        self, request_iterator: AsyncIterator[pb.EvaluateBatchRequest], context: Any
    ) -> None:
        core = self._core
        try:
            tenant = self._tenant_of(context)
        except EvaldError as exc:
            core.observe_call(STREAM_METHOD, "unauthenticated", exc.code.value)
            await context.abort(
                exc.code.grpc_status,
                exc.message,
                trailing_metadata=((ERROR_CODE_METADATA_KEY, exc.code.value),),
            )
            return
        await serve_stream(core, tenant, request_iterator, context, release_call_slot)

    async def ListEvaluators(
        self, request: pb.ListEvaluatorsRequest, context: Any
    ) -> pb.ListEvaluatorsResponse:
        async def body(tenant: Tenant) -> pb.ListEvaluatorsResponse:
            revision = self._control.revision  # before the list: never newer than what it shows
            evaluators = self._control.evaluators(tenant)
            return pb.ListEvaluatorsResponse(
                evaluators=[_evaluator_info(ev) for ev in evaluators],
                revision=revision,
                tenant=tenant.name,  # the one the call's own token authenticated
            )

        return await self._call("ListEvaluators", context, body)

    async def RegisterEvaluator(
        self, request: pb.RegisterEvaluatorRequest, context: Any
    ) -> pb.RegisterEvaluatorResponse:
        async def body(tenant: Tenant) -> pb.RegisterEvaluatorResponse:
            if not tenant.config.allow_register:
                where = (
                    "`evald tenants limits --may-register` in the fleet store"
                    if tenant.config.source == "store"
                    else "set allow_register = true for it in the daemon config"
                )
                raise EvaldError(
                    ErrorCode.PERMISSION_DENIED,
                    f"tenant {tenant.name!r} may not register evaluators ({where})",
                )
            wasm = bytes(request.module)
            evaluator = await self._control.register(
                tenant, wasm, request.replace, self._recheck(context)
            )
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
            return pb.RegisterEvaluatorResponse(
                evaluator=_evaluator_info(evaluator), revision=self._control.revision
            )

        return await self._call("RegisterEvaluator", context, body)

    async def DeleteEvaluator(
        self, request: pb.DeleteEvaluatorRequest, context: Any
    ) -> pb.DeleteEvaluatorResponse:
        async def body(tenant: Tenant) -> pb.DeleteEvaluatorResponse:
            evaluator = await self._control.delete(tenant, request.name, self._recheck(context))
            _log.info(
                "deleted evaluator",
                extra={"fields": {"tenant": tenant.name, "evaluator": evaluator.name}},
            )
            return pb.DeleteEvaluatorResponse(revision=self._control.revision)

        return await self._call("DeleteEvaluator", context, body)


def add_service(core: Core, control: ControlPlane, server: Any) -> None:
    """Serves ``evald.v1.Evaluator`` on ``server``: as the generated
    ``add_EvaluatorServicer_to_server`` registers it, but with lenient deserializers, so a
    malformed message gets ``invalid_argument``."""
    service = _Service(core, control)

    def guarded(method: str, handler: Callable[[Any, Any], Awaitable[Any]]) -> Any:
        async def unary(request: Any, context: Any) -> Any:
            if isinstance(request, Malformed):

                async def refuse(_tenant: Tenant) -> Any:
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
            request_deserializer=lenient(request_type),
            response_serializer=response_type.SerializeToString,
        )
        for name, (handler, request_type, response_type) in unary_methods.items()
    }
    handlers["EvaluateStream"] = grpc.stream_stream_rpc_method_handler(
        service.EvaluateStream,
        request_deserializer=lenient(pb.EvaluateBatchRequest),
        response_serializer=pb.EvaluateBatchResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
