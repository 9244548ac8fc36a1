"""A small blocking client for the daemon, used by the CLI, the demo and tests.

It speaks the public gRPC API and nothing else. Call-level failures become :class:`CallError`,
which tells apart "the daemon answered with an error" (``code`` set) from "the daemon could not
be reached" (``unreachable``), the distinction ``evald call`` turns into exit status 2 vs 1.
Engines use the streaming client of ``engine_adapter`` instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from evald.contract import (
    CLIENT_MAX_MESSAGE_BYTES,
    Endpoint,
    ErrorCode,
    TokenError,
    decode_rpc_error,
    default_target,
    pb,
    pb_grpc,
)

__all__ = ["CallError", "Client", "resolve_endpoint"]

#: gRPC statuses that mean nobody answered (rather than a refusal by the daemon).
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_STATUS_TO_CODE = {
    grpc.StatusCode.PERMISSION_DENIED: ErrorCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED: ErrorCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND: ErrorCode.UNKNOWN_EVALUATOR,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorCode.INVALID_ARGUMENT,
    grpc.StatusCode.INVALID_ARGUMENT: ErrorCode.INVALID_ARGUMENT,
}


class CallError(Exception):
    """A call failed. ``code`` is the daemon's error code, or None when it was not reached."""

    def __init__(self, code: ErrorCode | None, message: str, *, target: str) -> None:
        self.code = code
        self.message = message
        self.target = target
        super().__init__(f"{code.value if code else 'unreachable'}: {message}")

    @property
    def unreachable(self) -> bool:
        return self.code is None


def _call_error(error: grpc.RpcError, target: str) -> CallError:
    failure = decode_rpc_error(error)
    if failure.code is not None:
        return CallError(failure.code, failure.details, target=target)
    if failure.status in _UNREACHABLE:
        message = f"cannot reach the daemon at {target}: {failure.details}"
        return CallError(None, message, target=target)
    code = _STATUS_TO_CODE.get(failure.status, ErrorCode.INTERNAL)
    return CallError(code, failure.details, target=target)


def resolve_endpoint(
    target: str | None,
    token: str | None,
    *,
    env_token: bool = True,
    **tls: str | os.PathLike[str] | None,
) -> Endpoint:
    """:meth:`Endpoint.resolve`, with a malformed token reported as the daemon would: a
    :class:`CallError` with ``permission_denied`` (raised before anything is dialled).

    Raises:
        CallError: ``permission_denied``, the token named (argument or ``$EVALD_TOKEN``) is
            empty, blank or malformed.
    """
    try:
        return Endpoint.resolve(target, token, env_token=env_token, **tls)
    except TokenError as exc:
        raise CallError(
            ErrorCode.PERMISSION_DENIED, str(exc), target=target or default_target()
        ) from None


class Client:
    """A blocking connection to one daemon. Thread-safe (gRPC channels are).

    Parameters:
        target: ``unix:PATH`` or ``HOST:PORT``; default :func:`evald.default_target`.
        token: bearer token; default ``$EVALD_TOKEN``; none on the unix socket for the
            tokenless tenant.
        timeout_s: per-call timeout; a daemon that does not answer in time counts as unreachable.
        tls_ca: PEM file of the CA that signed the daemon's certificate (TCP with TLS).
        tls_cert, tls_key: the client's own certificate for mutual TLS.
        env_token: read ``$EVALD_TOKEN`` when ``token`` is None (False: None means none).

    Raises:
        CallError: ``permission_denied`` for a named token that is empty, blank or malformed.
    """

    def __init__(
        self,
        target: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = 10.0,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        max_message_bytes: int = CLIENT_MAX_MESSAGE_BYTES,
        env_token: bool = True,
    ) -> None:
        endpoint = resolve_endpoint(
            target, token, env_token=env_token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        self.target = endpoint.target
        self._metadata = endpoint.metadata
        self.timeout_s = timeout_s
        self._channel = endpoint.channel(max_message_bytes=max_message_bytes)
        self._stub = pb_grpc.EvaluatorStub(self._channel)  # type: ignore[no-untyped-call]
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _invoke(self, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            raise _call_error(error, self.target) from None

    def evaluate(
        self, evaluator: str, data: bytes | str, *, deadline_ms: int = 0, request_id: str = ""
    ) -> pb.EvaluateResponse:
        """One evaluation. Per-evaluation errors are in the response's ``error`` field.

        Raises:
            CallError: the call itself failed (authentication, unreachable daemon).
        """
        payload = data.encode("utf-8") if isinstance(data, str) else data
        request = pb.EvaluateRequest(
            evaluator=evaluator, input=payload, deadline_ms=deadline_ms, id=request_id
        )
        response: pb.EvaluateResponse = self._invoke(self._stub.Evaluate, request)
        return response

    def evaluate_batch(
        self, items: Iterable[tuple[str, bytes | str]], *, deadline_ms: int = 0
    ) -> list[pb.EvaluateResponse]:
        """Many evaluations in one message; results in request order (ids are the indexes)."""
        requests = [
            pb.EvaluateRequest(
                evaluator=name,
                input=data.encode("utf-8") if isinstance(data, str) else data,
                deadline_ms=deadline_ms,
                id=str(index),
            )
            for index, (name, data) in enumerate(items)
        ]
        response: pb.EvaluateBatchResponse = self._invoke(
            self._stub.EvaluateBatch, pb.EvaluateBatchRequest(items=requests)
        )
        return list(response.results)

    def evaluate_stream(
        self, batches: Iterable[Sequence[pb.EvaluateRequest]], *, timeout_s: float | None = None
    ) -> list[pb.EvaluateResponse]:
        """Sends each batch as one stream message and collects every result (completion order).

        For tests and tools; engines keep one long-lived stream instead.
        """
        requests = (pb.EvaluateBatchRequest(items=list(batch)) for batch in batches)
        results: list[pb.EvaluateResponse] = []
        try:
            for message in self._stub.EvaluateStream(
                requests, timeout=timeout_s or self.timeout_s, metadata=self._metadata
            ):
                results.extend(message.results)
        except grpc.RpcError as error:
            raise _call_error(error, self.target) from None
        return results

    def list_evaluators(self) -> list[pb.EvaluatorInfo]:
        """The evaluators this tenant may call."""
        response: pb.ListEvaluatorsResponse = self._invoke(
            self._stub.ListEvaluators, pb.ListEvaluatorsRequest()
        )
        return list(response.evaluators)

    def revision(self) -> int:
        """The daemon's revision of tenants and modules (``ListEvaluatorsResponse.revision``):
        it changes whenever what the daemon serves changes, so a client that cached evaluator
        specs knows when to list them again."""
        response: pb.ListEvaluatorsResponse = self._invoke(
            self._stub.ListEvaluators, pb.ListEvaluatorsRequest()
        )
        return int(response.revision)

    def listing(self) -> tuple[list[pb.EvaluatorInfo], int]:
        """The evaluators this tenant may call and the daemon's revision, from one answer (so
        the two always belong together)."""
        response = self.listing_response()
        return list(response.evaluators), int(response.revision)

    def listing_response(self) -> pb.ListEvaluatorsResponse:
        """The whole ``ListEvaluators`` answer: the evaluators, the daemon's revision and the
        name of the tenant this client's token authenticates (``tenant``; empty from a daemon
        older than that field), all from one answer."""
        response: pb.ListEvaluatorsResponse = self._invoke(
            self._stub.ListEvaluators, pb.ListEvaluatorsRequest()
        )
        return response

    def register(self, module: bytes, *, replace: bool = False) -> pb.EvaluatorInfo:
        """Registers a module (docs/abi.md) for this tenant.

        Raises:
            CallError: ``invalid_module`` with the validator's reason, ``permission_denied``,
                ``invalid_argument`` (name taken, too many modules), ``unavailable`` (storage).
        """
        response: pb.RegisterEvaluatorResponse = self._invoke(
            self._stub.RegisterEvaluator,
            pb.RegisterEvaluatorRequest(module=module, replace=replace),
            timeout_s=max(self.timeout_s, 30.0),
        )
        return response.evaluator

    def delete(self, name: str) -> None:
        """Deletes one of this tenant's modules."""
        self._invoke(self._stub.DeleteEvaluator, pb.DeleteEvaluatorRequest(name=name))

    def health(self, service: str = "") -> str:
        """The serving status name (``SERVING``, ``NOT_SERVING`` …) of ``service``."""
        response = self._invoke(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
