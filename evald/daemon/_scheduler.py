"""The fair scheduler: which tenant's admitted evaluations the guest workers run next.

Why a scheduler of its own rather than one pool task per item: a pool task per item costs a
thread hand-off per evaluation, and a FIFO pool lets one tenant's flood hold every worker. Here
each tenant has a queue of batches; a free worker takes the next ready tenant round-robin, runs
its items for one time slice (:data:`SLICE_S`), then moves on to the next tenant, so a large
batch costs a handful of hand-offs, and no tenant holds more than its ``running_cap`` workers at
once: one tenant's slow work cannot take every worker from the others.

It knows nothing of gRPC, of the data path or of the wasm host: it is given a ``run`` callable
(one admitted item in, its response out, on a worker thread) and a worker count, and the
transports give it batches (:meth:`Scheduler.enqueue`, :meth:`Scheduler.drain`) and take back
those their callers gave up on (:meth:`Scheduler.abandon`). Every item taken out of a queue is
either run or answered ``unavailable``, and either way its tenant's admission is released
exactly once (by ``run``, or by :meth:`Scheduler.abandon` through :meth:`TenantQueue.release`).

Locking: one lock (``Scheduler._lock``) guards the ready queue, the free-worker count and every
tenant's scheduling counters; a worker takes it once per slice, not per item. A batch's own
queue is a ``deque`` whose ``popleft`` is atomic, so workers and :meth:`Scheduler.abandon` may
take items from it without the lock.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Final, cast

from evald.contract import ErrorCode, pb
from evald.daemon._gatekeeping import error_response
from evald.daemon._priority import HEAVY_FOR_S, HEAVY_RUN_S

if TYPE_CHECKING:
    from evald.daemon._priority import Priorities
    from evald.daemon._registry import Evaluator
    from evald.host import Limits

__all__ = ["SLICE_S", "Batch", "Deliver", "Scheduler", "TenantQueue", "Work"]

#: A worker returns to the ready queue after running one tenant's items for this long, so other
#: tenants' calls interleave with a large batch.
SLICE_S: Final = 0.002


class TenantQueue:
    """One tenant's place in the scheduler: its queued batches and the workers it holds.

    The counters are guarded by the scheduler's lock. The daemon's tenant state
    (:class:`evald.daemon._admission.Tenant`) is one, so the scheduler reads them without an
    indirection per item.
    """

    def __init__(self, name: str, running_cap: int) -> None:
        self.name = name
        self.running_cap = running_cap  # at most this many workers at once
        self.running = 0  # workers this tenant holds
        self.queued = 0  # items queued and not yet counted as taken (never an undercount)
        self.batches: collections.deque[Batch] = collections.deque()
        self.ready = False  # in the scheduler's round-robin queue
        # Until then (time.monotonic()) its items run on lowered workers (evald.daemon._priority):
        # one of its evaluations used more than HEAVY_RUN_S of CPU. Written without the lock.
        self.heavy_until = 0.0

    def release(self) -> None:
        """Ends one admitted item that will not run (it is answered ``unavailable``); any thread.

        The scheduler admits nothing itself, so there is nothing to end here; a tenant whose
        items were admitted against a quota (the daemon's) gives the quota back.
        """


@dataclasses.dataclass(slots=True)
class Work:
    """One admitted evaluation waiting for a worker.

    Made once per item on the caller's thread: a plain slotted class costs about a third of a
    frozen dataclass (whose ``__init__`` goes through ``object.__setattr__`` per field).
    """

    index: int
    request_id: str
    evaluator: Evaluator
    data: bytes
    limits: Limits
    tenant: TenantQueue
    #: ``time.monotonic()`` by which the client wants the item answered: its arrival plus the
    #: request's own ``deadline_ms`` (0: none given, only the tenant's budget, which counts
    #: from the run's start). Time spent waiting for a worker counts against it: an item that
    #: waited past it is answered without running (docs/daemon.md, "Scheduling").
    due: float = 0.0
    reserved: int = 0  # stream output bytes reserved for this item's response


Deliver = Callable[[Work, pb.EvaluateResponse], None]


class Batch:
    """Items of one call being drained by worker jobs; ``done`` resolves when all finished.

    Without a loop (the data path, whose threads wait on nothing) there is no ``done``:
    ``deliver`` alone reports each result.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None,
        queue: collections.deque[Work],
        deliver: Deliver,
    ) -> None:
        self.loop = loop
        self.queue = queue
        self.deliver = deliver
        self.done: asyncio.Future[None] | None = loop.create_future() if loop is not None else None
        self._remaining = len(queue)
        self._lock = threading.Lock()
        self.tenant: TenantQueue = queue[0].tenant

    def finish(self, work: Work, response: pb.EvaluateResponse) -> None:
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


def _nothing() -> None:
    pass


class Scheduler:
    """Runs admitted batches on ``workers`` threads, fairly across tenants.

    Parameters:
        run: runs one item on the calling worker thread and returns its response; it must not
            raise, and it ends the item's admission itself (the scheduler releases only the
            items it answers without running).
        workers: guest worker threads.
        flush: called on a worker after a batch's last item and at the end of each slice (the
            daemon adds the thread's deferred metrics there); default: nothing.
        priorities: lowers the workers running a heavy tenant's items
            (:mod:`evald.daemon._priority`); None: every worker keeps its priority.
        uncharged: the CPU seconds of the item just run (on the calling worker) that were not
            its tenant's work, left out when deciding whether the tenant is heavy; default none.
        initializer: run first on each worker thread (the daemon pins them to its CPUs,
            :mod:`evald.daemon._cpu_affinity`); default none.
    """

    def __init__(
        self,
        run: Callable[[Work], pb.EvaluateResponse],
        workers: int,
        *,
        flush: Callable[[], None] = _nothing,
        priorities: Priorities | None = None,
        uncharged: Callable[[], float] = lambda: 0.0,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        self._run = run
        self._flush = flush
        #: CPU seconds of the item just run that were not its tenant's work (re-making an
        #: instance another tenant's calls pushed out of the worker's cache).
        self._uncharged = uncharged
        self.priorities = priorities
        self.pool = ThreadPoolExecutor(
            workers, thread_name_prefix="evald-guest", initializer=initializer
        )
        # Tenants with queued work and a free slot under their cap, in round-robin order, and
        # the workers not running a scheduling job.
        self._lock = threading.Lock()
        self._ready: collections.deque[TenantQueue] = collections.deque()
        self._free = workers
        self._closed = False

    async def drain(self, queue: collections.deque[Work], deliver: Deliver) -> None:
        """Runs every queued evaluation on the workers and returns when all have finished.

        ``deliver`` is called on a worker thread as each finishes. When the caller is
        cancelled, items not yet started are answered ``unavailable`` and release their quota.
        """
        if not queue:
            return
        batch = Batch(asyncio.get_running_loop(), queue, deliver)
        added, scheduled = self.enqueue(batch)
        try:
            if scheduled:
                await cast("asyncio.Future[None]", batch.done)
        finally:
            self.abandon(batch, added)

    def enqueue(self, batch: Batch) -> tuple[bool, bool]:
        """Puts a batch in its tenant's queue and wakes workers; any thread.

        Returns:
            (added, scheduled): whether the batch was queued, and whether workers will run it;
            a batch that is not scheduled must be answered by :meth:`abandon`.
        """
        tenant = batch.tenant
        with self._lock:
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

    def abandon(self, batch: Batch, added: bool) -> None:
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
            with self._lock:
                tenant.queued -= left
                with contextlib.suppress(ValueError):
                    tenant.batches.remove(batch)

    def close_scheduler(self) -> None:
        """Stops new batches from being scheduled (before ``pool.shutdown``); the workers still
        run everything already queued, and ``pool.shutdown(wait=True)`` returns once they have."""
        with self._lock:
            self._closed = True

    # Workers --------------------------------------------------------------------------------

    def _next_locked(self) -> TenantQueue | None:
        """Takes one worker slot for the next ready tenant (round-robin); lock held."""
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
            except RuntimeError:  # the pool is shut down: abandon() answers what is left
                tenant.running -= 1
                self._closed = True
                return
            self._free -= 1

    def _slice(self, tenant: TenantQueue) -> int:
        """Runs the tenant's queued items for one time slice; returns how many it took.

        Each item's CPU time decides whether the tenant is heavy; a heavy tenant's items run on
        a lowered worker, given back its priority when the slice ends (before the worker may
        start a pool thread, which would inherit the lowered priority). Every item's start and
        end are marked for the watchdog, which lowers an item that runs long while it runs.
        """
        clock = time.monotonic
        cpu = time.thread_time
        now = clock()
        end = now + SLICE_S
        used = cpu()  # this thread's CPU time when the item (and its delivery) began
        taken = 0
        batches = tenant.batches
        run = self._run
        uncharged = self._uncharged
        priorities = self.priorities
        watched = priorities.worker() if priorities is not None else None
        held = False
        try:
            while True:
                try:
                    batch = batches[0]
                except IndexError:
                    return taken
                try:
                    work = batch.queue.popleft()
                except IndexError:
                    with self._lock:
                        if batches and batches[0] is batch:
                            batches.popleft()
                    continue
                taken += 1
                if watched is not None:
                    deadline = now + work.limits.deadline_ms / 1000
                    if work.due and work.due < deadline:
                        deadline = work.due
                    if tenant.heavy_until > now:
                        cast("Priorities", priorities).hold(deadline)
                        held = True
                    watched.begin(used, deadline, now)
                    try:
                        response = run(work)
                    finally:
                        watched.end()
                else:
                    response = run(work)
                if not batch.queue:  # a batch's last item: its caller may read the metrics next
                    self._flush()
                batch.finish(work, response)
                spent = cpu()
                now = clock()
                # Re-making instances another tenant pushed out of the cache is not this
                # tenant's work: it is not counted for it.
                if spent - used - uncharged() > HEAVY_RUN_S:
                    tenant.heavy_until = now + HEAVY_FOR_S
                used = spent
                if now >= end:
                    return taken
        finally:
            if held:
                cast("Priorities", priorities).release()

    def _worker(self, tenant: TenantQueue | None) -> None:
        """A scheduling job: runs one slice for a tenant, gives the slot back and takes the
        next ready tenant, until none is ready; the lock is taken once per slice, not per
        item."""
        while tenant is not None:
            taken = 0
            try:
                taken = self._slice(tenant)
            finally:
                self._flush()
                with self._lock:
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
