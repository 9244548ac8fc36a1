"""What the protocol scenarios share: raw gRPC calls (bytes in, bytes out, so a request can be
anything), the one event loop for ``grpc.aio``, and how a refusal is judged.

A refusal must carry an ``evald-error-code`` (the daemon's typed errors); the only untyped
statuses accepted are the ones gRPC itself produces before the daemon sees the call (a message or
metadata over the transport's limits), and they are counted as such.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import grpc

from evald_lab.fuzz.checks import Violation
from evald_lab.fuzz.context import FuzzContext

__all__ = [
    "KLASS",
    "SERVICE",
    "UNARY_METHODS",
    "AioLoop",
    "Scenario",
    "raw_call_error",
    "raw_channel",
    "raw_method",
    "record_refusal",
]

#: The report class every protocol scenario records under.
KLASS = "protocol"
SERVICE = "/evald.v1.Evaluator"
UNARY_METHODS = (
    "Evaluate",
    "EvaluateBatch",
    "ListEvaluators",
    "RegisterEvaluator",
    "DeleteEvaluator",
)
#: gRPC statuses the transport returns before the daemon sees a call (no evald code possible).
_TRANSPORT_STATUSES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})

Scenario = Callable[[FuzzContext, random.Random], None]
_T = TypeVar("_T")


class AioLoop:
    """One event loop thread for every ``grpc.aio`` call of the process.

    grpc.aio binds its completion queue to the loop it first runs on; a fresh ``asyncio.run``
    per scenario (on whichever lane thread) leaves it calling into closed loops. Scenarios submit
    their coroutines here instead.
    """

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def run(cls, coroutine: Coroutine[Any, Any, _T]) -> _T:
        with cls._lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="fuzz-aio-loop", daemon=True).start()
                cls._loop = loop
            loop = cls._loop
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result()


def raw_method(channel: grpc.Channel, method: str) -> Callable[..., bytes]:
    """A unary method of the service, called with raw bytes (so a request can be anything)."""
    call: Callable[..., bytes] = channel.unary_unary(f"{SERVICE}/{method}")  # bytes in and out
    return call


def raw_call_error(error: grpc.RpcError) -> tuple[str | None, grpc.StatusCode, str]:
    """(evald code or None, gRPC status, details) of a failed raw call."""
    code: str | None = None
    for key, value in getattr(error, "trailing_metadata", lambda: ())() or ():
        if key == "evald-error-code":
            code = str(value)
    status = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else "") or ""
    return code, status, details


def record_refusal(
    ctx: FuzzContext,
    family: str,
    error: grpc.RpcError,
    expected: Sequence[str],
    *,
    transport_ok: bool = False,
) -> None:
    """Records a raw call's refusal as one input of ``family``: it must carry a typed code among
    ``expected`` and nothing of the other tenant; with ``transport_ok``, a status gRPC itself
    returns before the daemon sees the call is counted as such instead."""
    code, status, details = raw_call_error(error)
    if code is None and transport_ok and status in _TRANSPORT_STATUSES:
        ctx.recorder.outcome(KLASS, f"transport:{status.name.lower()}", family=family)
        return
    ctx.recorder.outcome(KLASS, f"call:{code or status.name.lower()}", family=family)
    if code is None:
        ctx.recorder.add(
            [
                Violation(
                    "untyped_error",
                    KLASS,
                    f"{family}: {status.name} without a code: {details[:160]}",
                )
            ]
        )
        return
    ctx.recorder.add(ctx.checker.call_error(KLASS, code, details, expected=expected))
    ctx.recorder.add(ctx.checker.text(KLASS, ctx.attacker, details))


def raw_channel(ctx: FuzzContext) -> grpc.Channel:
    """A channel whose message limits are above the daemon's, so that the daemon, not the
    client, is what refuses an oversized request."""
    limit = ctx.max_message_bytes * 2 + (1 << 20)
    return grpc.insecure_channel(
        ctx.target,
        options=(
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ),
    )
