"""The seam between the daemon and its two transports: what a transport may ask of the daemon
(:class:`Core`), and the rules both transports apply, each written once.

Why a seam: the daemon has two doors to the same evaluations, gRPC (:mod:`evald.daemon._service`,
on the asyncio loop) and the data path (:mod:`evald.daemon._data_path`, on threads). Every rule
a call or an item passes must hold on both, so a transport sees the daemon only as a
:class:`Core`, the dozen operations it needs (never the whole server, so nothing can grow into a
service locator), and the algorithms both need are plain synchronous code here, called by both:

* :class:`OutputBudget`: the unread output one stream or data connection holds, inside its
  tenant's ``unread_bytes``; every admitted item reserves the most its response can take until
  the response has left;
* :class:`Intake`: one request message's items, admitted in order while their responses fit the
  budget; when they no longer fit, the transport schedules what was admitted, waits for room its
  own way (an asyncio event, a condition) and calls again.

A transport keeps only its I/O: reading requests, waiting, sending responses.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from evald.contract import ErrorCode, EvaldError, pb
from evald.daemon._admission import Tenant, Transport
from evald.daemon._config import ServerSettings
from evald.daemon._gatekeeping import reservation
from evald.daemon._scheduler import Batch, Deliver, Work

__all__ = [
    "Admitted",
    "Core",
    "Intake",
    "OutputBudget",
    "Stoppable",
    "shutting_down",
]


def shutting_down() -> EvaldError:
    """The call-level error of a call or connection the daemon ends because it stops."""
    return EvaldError(ErrorCode.UNAVAILABLE, "the daemon is shutting down; reconnect to another")


class Stoppable(Protocol):
    """An open stream the daemon wakes when it stops, so it ends after its pending results."""

    def wake_to_stop(self) -> None: ...


class Core(Protocol):
    """What a transport may ask of the daemon (:class:`evald.daemon.EvaldServer` is one).

    Thread-safety: every method may be called from the event loop or a transport's threads,
    except :meth:`drain` (a coroutine of the daemon's loop).
    """

    @property
    def settings(self) -> ServerSettings:
        """The ``[server]`` table: message, stream and connection limits."""
        ...

    @property
    def stopping(self) -> bool:
        """True once the daemon has begun to stop: take nothing new."""
        ...

    def authenticate(self, metadata: Any, *, over_unix: bool) -> Tenant:
        """The tenant of a call's ``authorization`` metadata (a tokenless call only over unix).

        Raises:
            EvaldError: ``permission_denied`` with what to fix.
        """
        ...

    def authenticate_token(self, token: str | None, *, over_unix: bool) -> Tenant:
        """The tenant of a bearer ``token`` a connection presented itself (the data path's
        HELLO; None: no token, the tokenless tenant only over unix).

        Raises:
            EvaldError: ``permission_denied`` with what to fix.
        """
        ...

    def enter(self, tenant: Tenant, transport: Transport) -> Callable[[], None]:
        """Counts one call or connection of ``tenant`` (its ``max_calls``, its share of the
        transport's pool); returns its idempotent ``leave``.

        Raises:
            EvaldError: ``quota_exceeded``.
        """
        ...

    def enter_unauthenticated(
        self, transport: Transport, *, stream: bool = False
    ) -> Callable[[], None]:
        """Counts one caller with no tenant (yet) in the transport's small pool for them (a
        ``stream`` of responses in at most half of it); returns its idempotent ``leave``.

        Raises:
            EvaldError: ``unavailable`` when that pool is full.
        """
        ...

    def check_batch_size(self, items: int) -> None:
        """Refuses a message over ``max_batch_items`` (``invalid_argument``)."""
        ...

    def prepare(
        self, tenant: Tenant, request: pb.EvaluateRequest, index: int
    ) -> Work | pb.EvaluateResponse:
        """Resolves and admits one item, or answers it at once with its refusal."""
        ...

    def enqueue(self, batch: Batch) -> tuple[bool, bool]:
        """Schedules a batch on the guest workers: ``(added, scheduled)``."""
        ...

    def abandon(self, batch: Batch, added: bool) -> None:
        """Answers a batch's untaken items ``unavailable`` and releases their quota."""
        ...

    async def drain(self, queue: collections.deque[Work], deliver: Deliver) -> None:
        """Runs the items on the workers and returns when all have been delivered."""
        ...

    def observe_call(self, method: str, tenant: str, code: str) -> None:
        """Counts one finished call or connection in ``evald_rpcs``."""
        ...

    def track(self, stream: Stoppable) -> None:
        """Remembers an open stream until :meth:`untrack`, to wake it when the daemon stops."""
        ...

    def watch(
        self, tenant: Tenant, metadata: Any, end: Callable[[EvaldError], None]
    ) -> Callable[[], None]:
        """Remembers a long-lived call (a stream, a data-path connection) and the token in its
        ``metadata``; when that token is revoked, ``end`` is called (from any thread) with the
        ``unauthenticated`` error to end the call with. Returns the idempotent ``unwatch``."""
        ...

    def watch_token(
        self, tenant: Tenant, token: str | None, end: Callable[[EvaldError], None]
    ) -> Callable[[], None]:
        """:meth:`watch` for a connection that presented ``token`` itself (the data path)."""
        ...

    def untrack(self, stream: Stoppable) -> None: ...


class OutputBudget:
    """The unread output of one stream or data connection, inside its tenant's budget.

    Every admitted item reserves the most its response can take
    (:func:`~evald.daemon._gatekeeping.reservation`) from ``bound`` (the stream's
    ``stream_unread_bytes``) and from the tenant's ``unread_bytes`` (shared by all its streams
    and connections) until the response has left; a lone reservation always fits, so one large
    item never waits for nothing. When neither has room the transport stops reading, so a client
    that sends without reading stalls itself and nobody else.

    Thread-safe. ``notify`` is called (from any thread) whenever room may have been freed, here
    or anywhere in the tenant's budget; ``freed`` counts those moments, so a waiter that read it
    before a failed reservation knows whether to wait (no lost wake-up).
    """

    def __init__(self, tenant: Tenant, bound: int, notify: Callable[[], None]) -> None:
        self._tenant = tenant
        self._bound = bound
        self._notify = notify
        self._lock = threading.Lock()
        self.reserved = 0  # bytes reserved for responses that have not left yet
        self.freed = 0
        tenant.add_waiter(self)

    def try_reserve(self, size: int) -> bool:
        """Reserves ``size`` bytes for one response; False when they do not fit now."""
        with self._lock:
            if self.reserved and self.reserved + size > self._bound:
                return False
            if not self._tenant.reserve_unread(size):
                return False
            self.reserved += size
            return True

    def release(self, credit: int) -> None:
        """Responses of ``credit`` reserved bytes have left (any thread): back to both budgets.

        What :meth:`close` already returned is not returned twice.
        """
        with self._lock:
            credit = min(credit, self.reserved)
            self.reserved -= credit
            self.freed += 1
        if credit:
            self._tenant.free_unread(credit)  # wakes every waiter of the tenant, this one too
        else:
            self._notify()

    def wake(self) -> None:
        """The tenant freed room (any thread): whoever waits on this budget looks again."""
        with self._lock:
            self.freed += 1
        self._notify()

    def close(self) -> None:
        """Gives back what was never sent (the call ended) and stops listening to the tenant."""
        self._tenant.remove_waiter(self)
        with self._lock:
            unsent, self.reserved = self.reserved, 0
            self.freed += 1
        if unsent:
            self._tenant.free_unread(unsent)
        self._notify()


@dataclasses.dataclass(slots=True)
class Admitted:
    """What one :meth:`Intake.advance` admitted: the work to schedule, the refusals to answer
    (each with its reserved bytes), and whether items remain that wait for room."""

    queue: collections.deque[Work]
    refused: list[tuple[pb.EvaluateResponse, int]]
    blocked: bool
    #: ``OutputBudget.freed`` before the failed reservation: wait only while it is unchanged.
    seen: int


class Intake:
    """One request message's items, admitted in order while their responses fit ``budget``.

    Both transports call :meth:`advance` until nothing is left blocked: it admits items while
    their reservations fit, and returns what it admitted; when the next item does not fit, the
    transport schedules what was admitted (its results free room), waits until
    ``budget.freed != admitted.seen`` and calls again.

    Raises:
        EvaldError: ``invalid_argument`` at construction, for a message over
            ``max_batch_items``: none of its items is admitted.
    """

    __slots__ = ("_budget", "_core", "_items", "_next", "_output_bytes", "_tenant")

    def __init__(
        self,
        core: Core,
        tenant: Tenant,
        budget: OutputBudget,
        items: Sequence[pb.EvaluateRequest],
    ) -> None:
        core.check_batch_size(len(items))
        self._core = core
        self._tenant = tenant
        self._budget = budget
        self._items = items
        self._next = 0
        self._output_bytes = tenant.limits.output_bytes

    def advance(self) -> Admitted:
        queue: collections.deque[Work] = collections.deque()
        refused: list[tuple[pb.EvaluateResponse, int]] = []
        budget = self._budget
        seen = budget.freed
        items = self._items
        prepare = self._core.prepare
        tenant = self._tenant
        while self._next < len(items):
            index = self._next
            item = items[index]
            size = reservation(self._output_bytes, item.id)
            if not budget.try_reserve(size):
                return Admitted(queue, refused, True, seen)
            self._next = index + 1
            prepared = prepare(tenant, item, index)
            if isinstance(prepared, pb.EvaluateResponse):
                refused.append((prepared, size))
            else:
                prepared.reserved = size
                queue.append(prepared)
        return Admitted(queue, refused, False, seen)
