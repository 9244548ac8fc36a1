"""Starting another program from a process that may hold gRPC: vfork, never fork.

Python's ``Popen`` starts a child with vfork (or posix_spawn) unless it is given ``preexec_fn``,
``user``, ``group`` or ``extra_groups``: any of those makes it fork(). A fork() runs gRPC's fork
handlers, which restart gRPC's poller threads in the child; ``Popen`` then closes the inherited
descriptors, gRPC's epoll descriptor among them, and the child can die before it reaches its
exec (SIGSEGV, or ``ev_epoll1_linux.cc ... Check failed: next_worker->state == KICKED``). From a
process with one live channel, 29 and 87 of 400 fork-started children died that way in two runs;
of 800 started as below, none did. vfork and posix_spawn run no fork handlers (design.md §7).

So what used to run between fork and exec is done by a program the child executes first:
util-linux's ``setpriv`` (the user, its groups, the parent-death signal) and ``prlimit`` (resource
limits). Both execute the real command in the same process, so its pid, its parent and its exit
status stay the child's own. Where one of them is missing, :func:`child_start` falls back to a
``preexec_fn`` (which forks) for what it can do that way, and says so in
:attr:`ChildStart.forks`.
"""

from __future__ import annotations

import resource
import shutil
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ChildStart", "child_start"]

#: prlimit's option for each resource this module sets.
_PRLIMIT_OPTIONS: Mapping[int, str] = {
    resource.RLIMIT_AS: "as",
    resource.RLIMIT_CORE: "core",
    resource.RLIMIT_CPU: "cpu",
    resource.RLIMIT_DATA: "data",
    resource.RLIMIT_FSIZE: "fsize",
    resource.RLIMIT_MEMLOCK: "memlock",
    resource.RLIMIT_NOFILE: "nofile",
    resource.RLIMIT_NPROC: "nproc",
    resource.RLIMIT_STACK: "stack",
}


@dataclass(frozen=True)
class ChildStart:
    """What to give ``Popen``: ``Popen(start.argv, preexec_fn=start.preexec_fn, ...)``.

    Attributes:
        argv: the command, behind ``setpriv`` and ``prlimit`` where they are needed.
        preexec_fn: None (the child starts with vfork), or the fallback where a tool is missing.
        forks: whether ``Popen`` will fork (only with the fallback).
    """

    argv: list[str]
    preexec_fn: Callable[[], None] | None

    @property
    def forks(self) -> bool:
        return self.preexec_fn is not None


def child_start(
    argv: Sequence[str],
    *,
    death_signal: int | None = None,
    user: tuple[int, int] | None = None,
    rlimits: Mapping[int, tuple[int, int]] | None = None,
) -> ChildStart:
    """How to start ``argv`` with a parent-death signal, as another user, or under limits,
    without forking this process (see the module).

    Parameters:
        death_signal: ``PR_SET_PDEATHSIG``: the kernel sends it to the child when the thread
            that started it exits, so start it from the thread that lives as long as it should.
            setpriv sets it just before it executes the program: a starter that ends before
            then leaves the child without it.
        user: (uid, gid) the child runs as, with no supplementary groups (needs root).
        rlimits: resource → (soft, hard) limits (``resource.RLIMIT_*``).

    Raises:
        RuntimeError: ``user`` was asked for and ``setpriv`` is missing (a Popen ``user=``
            would fork: install util-linux).
        ValueError: a limit on a resource outside ``_PRLIMIT_OPTIONS`` (this module names
            prlimit's option for each resource it sets).
    """
    prefix: list[str] = []
    fallbacks: list[Callable[[], None]] = []
    setpriv = shutil.which("setpriv")
    options: list[str] = []
    if user is not None:
        if setpriv is None:
            raise RuntimeError(
                "running a program as another user needs setpriv (util-linux); install it"
            )
        uid, gid = user
        options += [f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    if death_signal is not None:
        if setpriv is not None:
            options.append(f"--pdeathsig={signal.Signals(death_signal).name}")  # names only
        else:
            fallbacks.append(lambda: _set_death_signal(int(death_signal)))
    if options:
        prefix += [str(setpriv), *options, "--"]
    if rlimits:
        unknown = set(rlimits) - set(_PRLIMIT_OPTIONS)
        if unknown:
            raise ValueError(f"no prlimit option for resource(s) {sorted(unknown)}")
        prlimit = shutil.which("prlimit")
        if prlimit is not None:
            prefix += [prlimit, *(_prlimit_option(k, v) for k, v in rlimits.items()), "--"]
        else:
            fallbacks.append(lambda: _set_limits(rlimits))
    return ChildStart([*prefix, *argv], _run_all(fallbacks) if fallbacks else None)


def _prlimit_option(which: int, limits: tuple[int, int]) -> str:
    soft, hard = (
        "unlimited" if value == resource.RLIM_INFINITY else str(value) for value in limits
    )
    return f"--{_PRLIMIT_OPTIONS[which]}={soft}:{hard}"


def _run_all(steps: Sequence[Callable[[], None]]) -> Callable[[], None]:
    def run() -> None:  # in the child, between fork and exec
        for step in steps:
            step()

    return run


def _set_limits(limits: Mapping[int, tuple[int, int]]) -> None:
    for which, pair in limits.items():
        resource.setrlimit(which, pair)


def _set_death_signal(signum: int) -> None:
    """``prctl(PR_SET_PDEATHSIG, signum)``; a no-op where ``prctl`` is missing (not Linux)."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    pr_set_pdeathsig = 1
    prctl(pr_set_pdeathsig, signum, 0, 0, 0)
