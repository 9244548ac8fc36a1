"""Registrations waiting to compile: a bounded queue, shared fairly between tenants.

Registrations compile one at a time (:class:`evald.host.Compiler`, a worker process), and one
may take up to ``compile_timeout_s``. Served first come, first served, eight slow registrations
from one tenant kept another tenant's registration waiting for 45 s, and a full queue turned
everybody else away. So:

* at most ``compile_queue`` registrations wait or compile at once (more get ``unavailable``);
* one tenant holds at most ``compile_queue_per_tenant`` of them (its share: more of its own
  get ``unavailable``, and the rest of the queue stays open to others);
* the next to compile is the oldest waiting registration of the tenant whose last turn lies
  furthest back (round-robin across the tenants that have one waiting), so a tenant waits for
  at most one registration of each other tenant, not for all of them.

On shutdown (:meth:`CompileQueue.close`) every registration still waiting gets ``unavailable``
at once; the one compiling is ended by the compiler's own deadline (``Compiler.stop``).

Event loop only: every method runs on the daemon's loop; the registration itself runs through
``run`` (the daemon's control thread).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from evald.contract import ErrorCode, EvaldError

__all__ = ["CompileQueue"]

_log = logging.getLogger("evald.compile_queue")

_T = TypeVar("_T")


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class _Waiting(Generic[_T]):
    """One registration in the queue: what it runs and where its result goes."""

    __slots__ = ("future", "job", "tenant")

    def __init__(
        self, tenant: str, job: Callable[[], Awaitable[_T]], future: asyncio.Future[_T]
    ) -> None:
        self.tenant = tenant
        self.job = job
        self.future = future


class CompileQueue:
    """Admits registrations within the queue's bounds and starts them one at a time, fairly.

    Parameters:
        capacity: ``compile_queue``, registrations waiting or compiling over all tenants.
        per_tenant: ``compile_queue_per_tenant``, the most one tenant may hold of them.
    """

    def __init__(self, *, capacity: int, per_tenant: int) -> None:
        self._capacity = capacity
        self._per_tenant = per_tenant
        #: Tenants with registrations waiting, in the order they first asked.
        self._waiting: OrderedDict[str, deque[_Waiting[Any]]] = OrderedDict()
        #: When each tenant last had its turn (a count of turns; forgotten tenants are few).
        self._served: dict[str, int] = {}
        self._turns = 0
        self._held: dict[str, int] = {}  # per tenant: waiting or compiling
        self._running: _Waiting[Any] | None = None
        self._task: asyncio.Future[None] | None = None  # the running registration's task
        self._closed_reason = ""

    @property
    def held(self) -> int:
        """Registrations waiting or compiling now, all tenants."""
        return sum(self._held.values())

    async def submit(self, tenant: str, job: Callable[[], Awaitable[_T]]) -> _T:
        """Waits for ``tenant``'s turn, runs ``job`` and returns what it returns.

        Raises:
            EvaldError: ``unavailable`` when the queue or the tenant's share of it is full, or
                the daemon is shutting down; whatever ``job`` raises.
        """
        if self._closed_reason:
            raise EvaldError(ErrorCode.UNAVAILABLE, self._closed_reason)
        held = self.held
        if held >= self._capacity:
            raise EvaldError(
                ErrorCode.UNAVAILABLE,
                f"{held} registrations are already waiting to compile (compile_queue is "
                f"{self._capacity}); retry shortly",
            )
        mine = self._held.get(tenant, 0)
        if mine >= self._per_tenant:
            raise EvaldError(
                ErrorCode.UNAVAILABLE,
                f"tenant {tenant!r} already has {mine} registrations waiting or compiling, its "
                f"share of the compile queue (compile_queue_per_tenant is {self._per_tenant}); "
                "retry when one has finished",
            )
        future: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        entry = _Waiting(tenant, job, future)
        self._held[tenant] = mine + 1
        self._waiting.setdefault(tenant, deque()).append(entry)
        self._start_next()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # the caller went away: a registration not begun is dropped; one compiling finishes
            # and its outcome is read here, so nothing is left unretrieved
            if not self._withdraw(entry):
                future.add_done_callback(_consume)
            raise

    def close(self, reason: str) -> None:
        """Refuses new registrations and every waiting one with ``unavailable: reason``."""
        self._closed_reason = reason
        waiting = [entry for entries in self._waiting.values() for entry in entries]
        self._waiting.clear()
        for entry in waiting:
            self._release(entry.tenant)
            if not entry.future.done():
                entry.future.set_exception(EvaldError(ErrorCode.UNAVAILABLE, reason))

    def _withdraw(self, entry: _Waiting[Any]) -> bool:
        """Takes a registration that has not begun out of the queue; False once it has."""
        entries = self._waiting.get(entry.tenant)
        if entries is None or entry not in entries:
            return False
        entries.remove(entry)
        if not entries:
            del self._waiting[entry.tenant]
        self._release(entry.tenant)
        return True

    def _release(self, tenant: str) -> None:
        left = self._held.get(tenant, 0) - 1
        if left > 0:
            self._held[tenant] = left
        else:
            self._held.pop(tenant, None)

    def _start_next(self) -> None:
        if self._running is not None or not self._waiting:
            return
        # round-robin: the tenant served longest ago (or never) goes first, so one that just
        # had its turn waits behind every other tenant with one waiting
        tenant = min(self._waiting, key=lambda name: self._served.get(name, -1))
        entries = self._waiting[tenant]
        entry = entries.popleft()
        if not entries:
            del self._waiting[tenant]
        self._turns += 1
        self._served[tenant] = self._turns
        self._running = entry
        # The order the queue decided, for operators and for tests of fairness (a client's
        # clock cannot tell which of two registrations compiled first).
        _log.info(
            "registration compiling",
            extra={"fields": {"tenant": tenant, "turn": self._turns, "waiting": self.held - 1}},
        )
        self._task = asyncio.ensure_future(self._run(entry))

    async def _run(self, entry: _Waiting[Any]) -> None:
        try:
            result = await entry.job()
        except BaseException as exc:  # handed to the waiting caller, whatever it is
            if not entry.future.done():
                entry.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            if not entry.future.done():
                entry.future.set_result(result)
        finally:
            self._running = None
            self._release(entry.tenant)
            self._start_next()
