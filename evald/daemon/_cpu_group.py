"""evald's own scheduling group yields while heavy work runs.

A nice value orders threads only inside their scheduling group. Linux gives each session its
own group (``CONFIG_SCHED_AUTOGROUP``, on in most distributions) and each cgroup with the CPU
controller its own as well, and it shares the CPU fairly between groups whatever the nice
values inside them. An engine started as its own service (SGLang, a systemd unit, a session of
its own) is in another group than evald: a worker lowered to nice 19 still takes its group's
fair share beside the engine's forward, and the forward, whose parallel regions wait for their
slowest thread, froze for 1.7 s next to two lowered 400 ms calls on a 2-core machine
(docs/sglang.md, "Where a plain request waits").

So while any worker is lowered, the watchdog (:class:`~evald.daemon._priority.Priorities`) also
lowers evald's group, when evald has one of its own: the session's autogroup, when evald leads
its session and no CPU cgroup decides instead (``/proc/self/autogroup``; the kernel lets any
process raise its group's nice value, and lower it back to 0, at most every 100 ms). Inside the
group the light tenants still go before the lowered workers. A cgroup's weight is its
supervisor's to set (``CPUWeight=`` in the shipped systemd unit, CPU requests in Kubernetes:
docs/operations.md); :func:`group_reason` says which case a daemon is in, for its start-up log.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Final

__all__ = ["AUTOGROUP_RETRY_S", "SHARED_SESSION", "AutogroupPriority", "group_reason"]

#: The kernel refuses a second change of any autogroup's nice value within 100 ms (EAGAIN,
#: for processes without CAP_SYS_ADMIN): a refused change is tried again after this long.
AUTOGROUP_RETRY_S: Final = 0.1

#: :func:`group_reason` for a daemon started inside another process's session.
SHARED_SESSION: Final = (
    "evald shares its session's scheduling group with the processes that started it: start it "
    "as a service or in a session of its own (setsid) for its heavy work to yield to other "
    "sessions' processes"
)

_AUTOGROUP = Path("/proc/self/autogroup")
_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")


def _cpu_cgroup() -> str:
    """The CPU cgroup this process is scheduled in ("/" for the root, where autogroups apply)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    unified = "/"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):  # cgroup v1's cpu controller
            return path
        if controllers == "":
            unified = path
    if unified == "/":
        return "/"
    # cgroup v2: the CPU controller applies if the parent hands it down.
    parent = Path("/sys/fs/cgroup") / unified.lstrip("/")
    try:
        enabled = (parent.parent / "cgroup.subtree_control").read_text().split()
    except OSError:
        return "/"
    return unified if "cpu" in enabled else "/"


def group_reason() -> str:
    """``""`` when evald can lower its own scheduling group (its session's autogroup), else
    why not: which group it shares the CPU in and who sets that group's weight."""
    try:
        if _ENABLED.read_text().strip() == "0":
            return (
                "autogroups are off (kernel.sched_autogroup_enabled = 0): nice values apply "
                "machine-wide"
            )
        own = _parse(_AUTOGROUP.read_text())
    except OSError:
        return "this kernel has no autogroups: nice values apply machine-wide"
    cgroup = _cpu_cgroup()
    if cgroup != "/":
        return (
            f"evald runs in the CPU cgroup {cgroup}: beside other services its share is that "
            "cgroup's weight (systemd CPUWeight=, Kubernetes CPU requests), set by its supervisor"
        )
    if os.getsid(0) != os.getpid():
        return SHARED_SESSION
    if own is None:  # init's group: PID 1 of a container, whose session is the root group
        return (
            "evald is in the root scheduling group (/proc/self/autogroup is empty, as for a "
            "container's PID 1): nice values apply beside the other processes there"
        )
    return ""


def _parse(text: str) -> int | None:
    """The nice value in ``/proc/<pid>/autogroup`` ("/autogroup-N nice V"); None when the
    file is empty, as the kernel leaves it for a process in the root group (init's session,
    whose weight nobody may change)."""
    fields = text.split()
    if len(fields) != 3 or fields[1] != "nice":
        return None
    try:
        return int(fields[2])
    except ValueError:
        return None


class AutogroupPriority:
    """evald's session autogroup, lowered to ``nice`` while heavy work runs.

    Only the watchdog thread calls :meth:`want` and :meth:`retry_at`.
    """

    def __init__(self, nice: int) -> None:
        self.nice = nice
        self.base = self._read()
        self.lowered = False
        self._retry_at = 0.0
        self.broken = False
        #: changes the kernel accepted (for tests and metrics)
        self.changes = 0

    def want(self, lowered: bool, now: float) -> None:
        """Lowers or restores the group; a change the kernel refuses for now is tried again
        from the next call at or after :meth:`retry_at`."""
        if lowered == self.lowered or self.broken or now < self._retry_at:
            return
        try:
            _AUTOGROUP.write_text(str(self.nice if lowered else self.base))
        except OSError as error:
            if error.errno == errno.EAGAIN:
                self._retry_at = now + AUTOGROUP_RETRY_S
            else:  # never expected after the start-up check: stop trying, keep serving
                self.broken = True
            return
        self.lowered = lowered
        self.changes += 1

    def retry_at(self, lowered: bool) -> float | None:
        """When :meth:`want` should be called again for ``lowered`` (None: nothing to do)."""
        if lowered == self.lowered or self.broken:
            return None
        return self._retry_at

    @staticmethod
    def _read() -> int:
        """The group's nice value now (0 when unreadable)."""
        try:
            return _parse(_AUTOGROUP.read_text()) or 0
        except OSError:
            return 0
