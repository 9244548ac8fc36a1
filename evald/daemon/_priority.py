"""Heavy tenants yield the CPU: a worker running a tenant whose evaluations run long is lowered to
a low CPU priority (a higher nice value) for as long as it runs them.

Why: with as many workers as CPUs, a tenant that burns its whole deadline on every call keeps a
CPU busy. A light call then needs several threads in turn (the event loop, a worker, the
client's), and each time one of them wakes on the busy CPU it waits for the kernel to preempt
the burning worker, up to a scheduler slice (milliseconds, against a call of half a
millisecond). A lowered worker is preempted at once by any thread of normal priority, so the
light calls of other tenants go first on a contended machine, while an idle machine runs the
heavy ones at full speed as before (docs/design.md, "Heavy tenants yield the CPU").

A tenant is *heavy* for :data:`HEAVY_FOR_S` after one of its evaluations has run longer than
:data:`HEAVY_RUN_S`: the scheduler marks it (:class:`~evald.daemon._scheduler.TenantQueue`), so
a tenant cannot escape by alternating light and heavy calls, and its first long call runs at
normal priority once per period at most.

The watchdog: a lowered thread on a busy machine gets little CPU, but it must run to notice its
epoch deadline and end the evaluation. A watchdog thread gives each lowered worker its normal
priority back at its current item's deadline, so the deadline holds as before.

Giving a priority back needs a permission that raising a nice value does not: root,
``CAP_SYS_NICE``, or an ``RLIMIT_NICE`` of at least 20 (the shipped systemd unit sets
``LimitNICE=+0``). :func:`can_restore_priority` finds out once, on a scratch thread; without it
the daemon logs why and leaves every priority alone.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from typing import Final

__all__ = ["HEAVY_FOR_S", "HEAVY_RUN_S", "Priorities", "can_restore_priority"]

#: An evaluation that runs longer than this makes its tenant heavy (a light one, a calc
#: expression, takes tens of microseconds).
HEAVY_RUN_S: Final = 0.005
#: A tenant stays heavy this long after its last long evaluation.
HEAVY_FOR_S: Final = 1.0

_NORMAL = 0


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


class Priorities:
    """Lowers worker threads while they run a heavy tenant's items; gives them back.

    Workers call :meth:`hold` before each item of a heavy tenant and :meth:`release` when they
    leave it; the watchdog thread (started at the first :meth:`hold`) restores a worker whose
    item's deadline has passed. A thread is lowered at most once per item and restored exactly
    once, by whichever comes first; the lock guards the table of lowered threads.
    """

    def __init__(self, nice: int) -> None:
        self.nice = nice
        self._cond = threading.Condition()
        # native thread id -> (its item's deadline, the nice value it had before)
        self._lowered: dict[int, tuple[float, int]] = {}
        self._watchdog: threading.Thread | None = None
        self._closed = False

    def hold(self, deadline_s: float) -> None:
        """Lowers the calling worker thread until :meth:`release`, or until ``deadline_s``
        (``time.monotonic()``) passes; it gets back the nice value it had (the daemon's own,
        0 unless it was started niced)."""
        tid = threading.get_native_id()
        with self._cond:
            if self._closed:
                return
            held = self._lowered.get(tid)
            base = held[1] if held is not None else _current(tid)
            self._lowered[tid] = (deadline_s, base)
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch, name="evald-priority-watchdog", daemon=True
                )
                self._watchdog.start()
            self._cond.notify()
            if held is None and base < self.nice:
                self._set(tid, self.nice)

    def release(self) -> None:
        """Gives the calling worker thread its priority back, if it was lowered."""
        tid = threading.get_native_id()
        with self._cond:
            held = self._lowered.pop(tid, None)
            if held is not None:
                self._set(tid, held[1])

    def close(self) -> None:
        """Restores every lowered thread and stops the watchdog."""
        with self._cond:
            self._closed = True
            for tid, (_deadline, base) in self._lowered.items():
                self._set(tid, base)
            self._lowered.clear()
            self._cond.notify()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)

    def lowered(self) -> int:
        """How many worker threads are lowered now (for tests and metrics)."""
        with self._cond:
            return len(self._lowered)

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for tid, (deadline, base) in list(self._lowered.items()):
                    if deadline <= now:
                        del self._lowered[tid]
                        self._set(tid, base)
                if self._lowered:
                    earliest = min(deadline for deadline, _base in self._lowered.values())
                    self._cond.wait(max(0.0, earliest - now))
                else:
                    self._cond.wait()

    @staticmethod
    def _set(tid: int, nice: int) -> None:
        # ESRCH: the thread is gone (the pool shut down); EPERM cannot happen after the probe.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
