"""Heavy work yields the CPU: a worker whose evaluation runs long is lowered to a low CPU
priority (a higher nice value) while it runs it, and a tenant whose evaluations run long has
all its items run lowered for a while.

Why: with as many workers as CPUs, a tenant that burns its whole deadline on every call keeps a
CPU busy. A light call then needs several threads in turn (the event loop, a worker, the
client's), and each time one of them wakes on the busy CPU it waits for the kernel to preempt
the burning worker, up to a scheduler slice (milliseconds, against a call of half a
millisecond). An inference engine on the same machine fares worse: its forward runs one thread
per core and every parallel region waits for the slowest, so one worker burning a core at
normal priority slows every step of every sequence in the batch, other tenants' plain
requests included (docs/sglang.md, "Where a plain request waits"). A lowered worker is preempted
at once by any thread of normal priority, so other tenants' work and the engine go first on a
contended machine, while an idle machine runs the heavy calls at full speed as before
(docs/design.md, "Heavy work yields the CPU").

Two rules, both by the CPU a call has used of its own:

- *In flight.* A call that has used more than :data:`HEAVY_RUN_S` of CPU is lowered while it
  runs: the watchdog thread reads each running worker's CPU clock every :data:`POLL_S` while
  any worker is in a call, so a long call runs at normal priority for a few milliseconds at
  most, its tenant's first one included. Light calls cost the worker two attribute writes; the
  watchdog is woken only by the first call after it went idle (:data:`IDLE_AFTER_S` without
  one).
- *Heavy tenants.* A tenant is heavy for :data:`HEAVY_FOR_S` after one of its calls used more
  than :data:`HEAVY_RUN_S`: the scheduler marks it (:class:`~evald.daemon._scheduler.TenantQueue`)
  and its items run lowered from their start, so a tenant cannot escape by alternating light
  and heavy calls.

A lowered thread on a busy machine gets little CPU, but it must run to notice its epoch deadline
and end the evaluation: the watchdog gives each lowered worker its normal priority back at its
current item's deadline, so the deadline holds as before.

Giving a priority back needs a permission that raising a nice value does not: root,
``CAP_SYS_NICE``, or an ``RLIMIT_NICE`` of at least 20 (the shipped systemd unit sets
``LimitNICE=+0``). :func:`can_restore_priority` finds out once, on a scratch thread; without it
the daemon logs why and leaves every priority alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import threading
import time
from typing import Final

from evald.daemon._cpu_group import AutogroupPriority, group_reason

__all__ = [
    "GROUP_HOLD_S",
    "HEAVY_FOR_S",
    "HEAVY_RUN_S",
    "IDLE_AFTER_S",
    "POLL_S",
    "Priorities",
    "WorkerPriority",
    "can_restore_priority",
    "heavy_tenant_priorities",
]

_log = logging.getLogger("evald.server")

#: A call that has used more than this much CPU is heavy: it runs lowered from then on, and its
#: tenant is heavy (a light call, a calc expression, takes tens of microseconds).
HEAVY_RUN_S: Final = 0.005
#: A tenant stays heavy this long after its last heavy call.
HEAVY_FOR_S: Final = 1.0
#: While any worker is in a call, the watchdog reads the running workers' CPU clocks this often
#: (wall clock): a heavy call is lowered after at most about HEAVY_RUN_S + POLL_S.
POLL_S: Final = 0.004
#: The watchdog sleeps until woken once no call has run for this long.
IDLE_AFTER_S: Final = 0.1
#: evald's own scheduling group (evald.daemon._cpu_group) stays lowered this long after the
#: last lowered worker: the kernel changes a group's nice value at most every 100 ms, so a
#: group given back between two heavy calls would run the next one at full weight.
GROUP_HOLD_S: Final = 0.2

_NORMAL = 0
_NOT_RUNNING = -1.0


def _raise_rlimit_nice() -> None:
    """Raises the soft RLIMIT_NICE to the hard limit: it decides whether a
    lowered thread can have its nice value back."""
    with contextlib.suppress(OSError, ValueError):
        _soft, hard = resource.getrlimit(resource.RLIMIT_NICE)
        resource.setrlimit(resource.RLIMIT_NICE, (hard, hard))


def can_restore_priority(nice: int) -> str:
    """Tries to lower a scratch thread to ``nice`` and back to the nice value it started with;
    returns ``""`` when that works, else why not (for the log)."""
    _raise_rlimit_nice()
    failure: list[str] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            base = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, max(base, nice))
            os.setpriority(os.PRIO_PROCESS, tid, base)
        except OSError as error:
            failure.append(
                f"{error.strerror or error}: lowering a thread to nice {nice} and back needs "
                "root, CAP_SYS_NICE or RLIMIT_NICE >= 20 (systemd: LimitNICE=+0)"
            )

    thread = threading.Thread(target=probe, name="evald-nice-probe", daemon=True)
    thread.start()
    thread.join()
    return failure[0] if failure else ""


def _current(tid: int) -> int:
    """A thread's nice value now (0 if it cannot be read)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        return _NORMAL


class WorkerPriority:
    """One worker thread's priority state; made by :meth:`Priorities.worker` on that thread.

    The worker writes :attr:`began` and :attr:`item_deadline` without a lock (plain attribute
    writes, ordered by the GIL); everything else is guarded by the owning
    :class:`Priorities`' lock.
    """

    __slots__ = (
        "_owner",
        "base",
        "began",
        "began_at",
        "clock",
        "deadline",
        "held",
        "item",
        "item_deadline",
        "lowered",
        "spent",
        "tid",
    )

    def __init__(self, owner: Priorities) -> None:
        self._owner = owner
        self.tid = threading.get_native_id()
        #: the thread's CPU clock, which the watchdog reads
        self.clock = time.pthread_getcpuclockid(threading.get_ident())
        #: the thread's CPU time when its current call began; _NOT_RUNNING between calls
        self.began = _NOT_RUNNING
        #: when its current call began (time.monotonic()), as its caller read the clock
        self.began_at = 0.0
        self.item = 0  # calls begun, so the watchdog can tell one call from the next
        self.item_deadline = 0.0  # the current call's deadline (time.monotonic())
        self.lowered = False
        self.held = False  # lowered by hold() until release(), not by the watchdog
        self.base = _NORMAL  # the nice value to restore
        self.deadline = 0.0  # restored by the watchdog at this time while lowered
        self.spent = -1  # the call whose deadline restored it: not lowered again

    def begin(self, cpu_s: float, deadline_s: float, at_s: float) -> None:
        """The worker starts a call; ``cpu_s`` is its CPU time now (``time.thread_time()``),
        ``deadline_s`` the call's deadline and ``at_s`` the time now (``time.monotonic()``)."""
        self.item += 1
        self.item_deadline = deadline_s
        self.began_at = at_s
        self.began = cpu_s
        if self._owner.idle:
            self._owner.wake()

    def end(self) -> None:
        """The worker's call ended: a call the watchdog lowered gets its priority back."""
        self.began = _NOT_RUNNING
        if self.lowered and not self.held:
            self._owner.restore_after_call(self)


class Priorities:
    """Lowers worker threads while they run heavy work; gives them back.

    Each worker thread takes its :class:`WorkerPriority` once (:meth:`worker`) and marks every
    call's start and end on it; the watchdog thread (started with the first worker) lowers a
    call that has run long and restores a lowered worker at its call's deadline. A heavy
    tenant's items are lowered from their start by :meth:`hold`, until :meth:`release`. A thread
    is restored exactly once per lowering, by whichever comes first.
    """

    def __init__(self, nice: int, group: AutogroupPriority | None = None) -> None:
        self.nice = nice
        #: evald's own scheduling group, lowered while any worker is (evald.daemon._cpu_group)
        self.group = group
        self._cond = threading.Condition()
        self._workers: dict[int, WorkerPriority] = {}  # by native thread id
        self._watchdog: threading.Thread | None = None
        self._closed = False
        #: the watchdog sleeps until woken (no call ran for IDLE_AFTER_S); read without the lock
        self.idle = False
        self._lowered_in_flight = 0
        #: evald's group stays lowered until then (time.monotonic()): GROUP_HOLD_S after the
        #: last lowered worker, counted from when it was given back, not from the watchdog's
        #: last look (on a loaded machine the watchdog may look late); lock held
        self._group_until = 0.0

    # Worker side ----------------------------------------------------------------------------

    def worker(self) -> WorkerPriority:
        """The calling worker thread's priority state (made at its first call)."""
        tid = threading.get_native_id()
        found = self._workers.get(tid)
        if found is not None:
            return found
        with self._cond:
            found = self._workers.get(tid)
            if found is None:
                found = self._workers[tid] = WorkerPriority(self)
            if self._watchdog is None and not self._closed:
                self._watchdog = threading.Thread(
                    target=self._watch, name="evald-priority-watchdog", daemon=True
                )
                self._watchdog.start()
            return found

    def wake(self) -> None:
        """Wakes the idle watchdog (a call began)."""
        with self._cond:
            self.idle = False
            self._cond.notify()

    def hold(self, deadline_s: float) -> None:
        """Lowers the calling worker thread until :meth:`release`, or until ``deadline_s``
        (``time.monotonic()``) passes; it gets back the nice value it had (the daemon's own,
        0 unless it was started niced)."""
        worker = self.worker()
        with self._cond:
            if self._closed:
                return
            worker.deadline = deadline_s
            worker.held = True
            if not worker.lowered:
                self._lower(worker)
            self._cond.notify()

    def release(self) -> None:
        """Gives the calling worker thread its priority back, if :meth:`hold` lowered it."""
        worker = self._workers.get(threading.get_native_id())
        if worker is None:
            return
        with self._cond:
            if worker.held:
                worker.held = False
                if worker.lowered:
                    self._restore(worker)

    def restore_after_call(self, worker: WorkerPriority) -> None:
        """Gives a worker the watchdog lowered its priority back at its call's end."""
        with self._cond:
            if worker.lowered and not worker.held:
                self._restore(worker)

    def close(self) -> None:
        """Restores every lowered thread and stops the watchdog."""
        with self._cond:
            self._closed = True
            for worker in self._workers.values():
                worker.held = False
                if worker.lowered:
                    self._restore(worker)
            self._cond.notify()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
        if self.group is not None:
            self.group.want(False, time.monotonic())

    def lowered(self) -> int:
        """How many worker threads are lowered now (for tests and metrics)."""
        with self._cond:
            return sum(1 for worker in self._workers.values() if worker.lowered)

    def lowered_in_flight(self) -> int:
        """How many calls the watchdog has lowered while they ran (for tests and metrics)."""
        with self._cond:
            return self._lowered_in_flight

    # The watchdog ---------------------------------------------------------------------------

    def _lower(self, worker: WorkerPriority) -> None:
        """Lock held."""
        worker.base = _current(worker.tid)
        worker.lowered = True
        if worker.base < self.nice:
            self._set(worker.tid, self.nice)

    def _restore(self, worker: WorkerPriority) -> None:
        """Lock held."""
        worker.lowered = False
        self._set(worker.tid, worker.base)
        self._group_until = max(self._group_until, time.monotonic() + GROUP_HOLD_S)

    def _check(self, worker: WorkerPriority, now: float) -> bool:
        """One look at one worker; lock held. Returns whether it is in a call."""
        if worker.lowered and worker.deadline <= now:
            worker.held = False
            worker.spent = worker.item  # its deadline passed: it runs to its end as it is
            self._restore(worker)
        began, item = worker.began, worker.item
        if began == _NOT_RUNNING:
            return False
        if worker.lowered or item == worker.spent:
            return True
        try:
            used = time.clock_gettime(worker.clock) - began
        except OSError:  # the thread is gone
            return False
        if used <= HEAVY_RUN_S:
            return True
        worker.deadline = worker.item_deadline
        self._lower(worker)
        self._lowered_in_flight += 1
        # The call may have ended while we looked: the worker's end() read `lowered` before
        # we set it, so give the priority back here.
        if worker.item != item or worker.began == _NOT_RUNNING:
            self._restore(worker)
        return True

    def _watch(self) -> None:
        clock = time.monotonic
        with self._cond:
            quiet_since = clock()
            while not self._closed:
                now = clock()
                running = False
                for worker in list(self._workers.values()):
                    running = self._check(worker, now) or running
                if running:
                    quiet_since = now
                deadlines = [w.deadline for w in self._workers.values() if w.lowered]
                group = self.group
                if group is not None:
                    if deadlines:
                        self._group_until = max(self._group_until, now + GROUP_HOLD_S)
                    group_until = self._group_until
                    # A call that began inside the hold keeps the group until it ends or is
                    # found heavy: on a loaded machine the watchdog may first look at it after
                    # the hold, and a group given back then would run it at full weight.
                    want = now < group_until or any(
                        w.began != _NOT_RUNNING and w.began_at < group_until
                        for w in self._workers.values()
                    )
                    group.want(want, now)
                    retry = group.retry_at(want)
                    if retry is not None:  # the kernel refused the change for now
                        deadlines.append(retry)
                    elif want:  # give the group back once the hold has passed
                        deadlines.append(group_until)
                if running or now - quiet_since < IDLE_AFTER_S:
                    wait = POLL_S
                elif deadlines:
                    wait = max(0.0, min(deadlines) - now)
                else:
                    # Idle from here; a call that began before `idle` was set is seen below
                    # (its worker reads `idle` after writing `began`, this thread the other
                    # way round), one that begins after wakes the watchdog.
                    self.idle = True
                    if not any(w.began != _NOT_RUNNING for w in self._workers.values()):
                        self._cond.wait()
                    self.idle = False
                    quiet_since = clock()
                    continue
                if deadlines:
                    wait = min(wait, max(0.0, min(deadlines) - now))
                self._cond.wait(wait)

    @staticmethod
    def _set(tid: int, nice: int) -> None:
        # ESRCH: the thread is gone (the pool shut down); EPERM cannot happen after the probe.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def heavy_tenant_priorities(nice: int) -> Priorities | None:
    """Lowering heavy tenants' workers (``[server] heavy_tenant_nice``), when configured and
    permitted (else logged, off), with evald's own scheduling group when it has one."""
    if nice <= 0:
        return None
    why_not = can_restore_priority(nice)
    if why_not:
        _log.warning(
            "heavy tenants keep their CPU priority",
            extra={"fields": {"heavy_tenant_nice": nice, "reason": why_not}},
        )
        return None
    reason = group_reason()
    if reason:
        _log.info(
            "evald's scheduling group is not its own to lower",
            extra={"fields": {"heavy_tenant_nice": nice, "reason": reason}},
        )
    return Priorities(nice, None if reason else AutogroupPriority(nice))
