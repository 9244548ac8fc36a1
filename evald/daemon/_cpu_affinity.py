"""The CPUs evald runs on (``[server] cpus``, ``evald serve --cpus``), apart from an engine's.

Why: an inference engine's CPU forward runs one OpenMP thread bound to each of its cores, and
every parallel region waits for the slowest; any runnable thread on those cores stretches every
step, even one of evald's workers lowered to nice 19 (docs/sglang.md, "Where a plain request
waits"). Lowering priority cannot fix that; only not sharing the cores can. So evald can be
confined to cores of its own, and the engine bound to the others (docs/operations.md,
"Partitioning the CPU").

The setting is a Linux cpu-list (``"1"``, ``"2-3,6"``, as ``taskset -c`` and
``/proc/PID/status``'s ``Cpus_allowed_list`` write it). It is applied with
``sched_setaffinity``, which on Linux sets one thread's CPUs; a thread or process started
afterwards inherits its starter's. ``evald serve``, a process of its own, pins every thread it
has at start (:func:`pin_process`), so everything it starts later inherits the set; an
embedded :class:`~evald.daemon.EvaldServer` pins only the threads it starts to run tenants'
work (its workers, its control and module threads, and through them the compile worker
process), never the process that embeds it (:func:`pin_thread`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

from evald.daemon._config_table import ConfigError

__all__ = [
    "CPU_LIST_EXAMPLE",
    "available_cpus",
    "check_cpus",
    "format_cpu_list",
    "parse_cpu_list",
    "pin_process",
    "pin_thread",
    "pinning",
    "unavailable_cpus",
]

#: How the setting is written, for messages.
CPU_LIST_EXAMPLE: Final = '"1" or "2-3,6"'

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
#: Far above any machine's CPU count: a typo such as "0-99999999" is refused, not allocated.
_MAX_CPU = 1 << 16


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a Linux cpu-list (``"0"``, ``"2-3,6"``; blanks around items ignored).

    Raises:
        ValueError: not a cpu-list, a range that runs backwards, or no CPU at all (the message
            says which part, for the caller to name its key).
    """
    items = [item.strip() for item in text.split(",")]
    if not text.strip():
        raise ValueError(
            f"an empty CPU list; name at least one CPU ({CPU_LIST_EXAMPLE}), or leave the "
            "setting out to run on every CPU the daemon is given"
        )
    cpus: set[int] = set()
    for item in items:
        match = _RANGE.fullmatch(item)
        if match is None:
            raise ValueError(f"expected a Linux CPU list such as {CPU_LIST_EXAMPLE}, got {text!r}")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ValueError(f"the range {item!r} runs backwards (write {last}-{first})")
        if last >= _MAX_CPU:
            raise ValueError(f"CPU {last} in {text!r} is beyond any machine's CPUs")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``cpus`` as a Linux cpu-list, ranges joined (``{2, 3, 6}`` → ``"2-3,6"``)."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        first, last = ordered[start], ordered[end]
        parts.append(str(first) if first == last else f"{first}-{last}")
        start = end + 1
    return ",".join(parts)


def available_cpus() -> frozenset[int]:
    """The CPUs the calling thread may run on (its starter's affinity, a cgroup's cpuset)."""
    return frozenset(os.sched_getaffinity(0))


def unavailable_cpus(cpus: Iterable[int]) -> str:
    """``""`` when every CPU of ``cpus`` is available to the calling thread, else a message
    that names the missing ones and those it has."""
    have = available_cpus()
    missing = set(cpus) - have
    if not missing:
        return ""
    return (
        f"CPU {format_cpu_list(missing)} is not available to the daemon: it may run on "
        f"{format_cpu_list(have)} (the machine's online CPUs, narrowed by taskset, a cgroup "
        "cpuset or a container's CPU set)"
    )


def check_cpus(configured: frozenset[int], source: str) -> frozenset[int]:
    """The CPUs a daemon starting now runs on: ``configured`` (``[server] cpus``) once checked
    against those the calling thread may use, else all of those.

    Raises:
        ConfigError: a configured CPU is not available (the message names it, the file and
            the key).
    """
    why_not = unavailable_cpus(configured)
    if why_not:
        raise ConfigError(f"{source}: server.cpus: {why_not}")
    return configured or available_cpus()


def pin_thread(cpus: frozenset[int]) -> None:
    """Confines the calling thread to ``cpus`` (nothing when empty); threads and processes it
    starts afterwards inherit them."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def pinning(cpus: frozenset[int]) -> Callable[[], None] | None:
    """A thread pool's ``initializer`` that pins each of its threads to ``cpus``; None when
    empty (the threads keep their starter's CPUs)."""
    if not cpus:
        return None

    def pin() -> None:
        pin_thread(cpus)

    return pin


def pin_process(cpus: frozenset[int]) -> None:
    """Confines every thread of this process to ``cpus`` (nothing when empty), so whatever it
    starts from now on inherits them. A thread that ends meanwhile is skipped."""
    if not cpus:
        return
    pin_thread(cpus)  # the caller's first: a thread it starts meanwhile inherits the set
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{os.getpid()}/task").iterdir():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(task.name), cpus)
