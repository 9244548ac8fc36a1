"""Children started beside live gRPC channels reach their exec (evald.daemon.child_start).

A ``Popen`` with ``preexec_fn``, ``user`` or ``group`` forks, gRPC's fork handlers restart its
poller in the child, and the child can die before its exec: a CI run lost ``initdb`` that way
(``ev_epoll1_linux.cc ... Check failed``). :func:`child_start` moves that work into ``setpriv``
and ``prlimit`` so ``Popen`` can use vfork. These tests start real children from a process that
holds a real channel to a real gRPC server, and read what the children got from the kernel.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import resource
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from evald.daemon import child_start

#: Enough children that the fork-started ones lose some (29 and 87 of 400 were lost in two runs).
CHILDREN = 300

SERVER = textwrap.dedent("""
    import sys, time
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    server.start()
    sys.stdin.read()
""")

CHILD_REPORT = textwrap.dedent("""
    import ctypes, json, os
    death = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(death), 0, 0, 0)  # PR_GET_PDEATHSIG
    limits = {line[:26].strip(): line[26:].split()[:2] for line in open("/proc/self/limits")}
    print(json.dumps({
        "ids": [os.getuid(), os.getgid()], "groups": os.getgroups(), "death": death.value,
        "cpu": limits["Max cpu time"], "core": limits["Max core file size"],
        "fsize": limits["Max file size"],
    }))
""")


@pytest.fixture
def live_channel() -> Iterator[None]:
    """A channel to a gRPC server in another process, with a watch open and calls going on."""
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    port = int(server.stdout.readline())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
    watch = stub.Watch(health_pb2.HealthCheckRequest())
    done = threading.Event()

    def read_watch() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled at the end
            for _ in watch:
                pass

    def call() -> None:
        while not done.wait(0.01):
            stub.Check(health_pb2.HealthCheckRequest(), timeout=30)

    threads = [threading.Thread(target=f, daemon=True) for f in (read_watch, call)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        done.set()
        watch.cancel()
        for thread in threads:
            thread.join(timeout=30)
        channel.close()
        server.communicate(timeout=30)


def _as_whom() -> tuple[int, int] | None:
    """nobody, when this test runs as root (else the user cannot change)."""
    if os.geteuid() != 0:
        return None
    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


def test_children_reach_their_exec_beside_a_live_channel(live_channel: None) -> None:
    start = child_start(
        ["/bin/true"],
        death_signal=signal.SIGTERM,
        user=_as_whom(),
        rlimits={resource.RLIMIT_CORE: (0, 0)},
    )
    assert not start.forks
    lost = []
    for _ in range(CHILDREN):
        run = subprocess.run(start.argv, capture_output=True, preexec_fn=start.preexec_fn)
        if run.returncode != 0 or run.stderr:
            lost.append((run.returncode, run.stderr[:200]))
    assert lost == [], f"{len(lost)} of {CHILDREN} children died before or at their exec"


def _status(text: str) -> dict[str, list[str]]:
    """/proc/PID/status (``Uid:``, ``Groups:`` ...) and /proc/PID/limits, read by ``cat``."""
    fields = {}
    for line in text.splitlines():
        if line.startswith("Max "):
            fields[line[:26].strip()] = line[26:].split()[:2]
        elif ":" in line:
            name, _, value = line.partition(":")
            fields[name] = value.split()
    return fields


def test_the_child_gets_its_user_and_limits() -> None:
    whom = _as_whom()
    start = child_start(
        ["cat", "/proc/self/status", "/proc/self/limits"],
        death_signal=signal.SIGQUIT,
        user=whom,
        rlimits={
            resource.RLIMIT_CPU: (7, 8),
            resource.RLIMIT_CORE: (0, 0),
            resource.RLIMIT_FSIZE: (resource.RLIM_INFINITY, resource.RLIM_INFINITY),
        },
    )
    report = _status(subprocess.run(start.argv, capture_output=True, text=True, check=True).stdout)
    if whom is not None:
        assert report["Uid"] == [str(whom[0])] * 4 and report["Gid"] == [str(whom[1])] * 4
        assert report["Groups"] == []
    assert (report["Max cpu time"], report["Max core file size"]) == (["7", "8"], ["0", "0"])
    assert report["Max file size"] == ["unlimited", "unlimited"]


def test_the_death_signal_comes_when_the_starting_thread_ends() -> None:
    """setpriv sets the signal after it changes the user (a change would clear it), and the pid
    stays the child's: the kernel's signal reaches the program itself.

    The starter waits until the child runs ``sleep``: setpriv sets the signal just before that
    exec, and a signal set after its parent thread has ended never comes (as with prctl).
    """
    start = child_start(["sleep", "60"], death_signal=signal.SIGTERM, user=_as_whom())
    started: list[subprocess.Popen[bytes]] = []

    def starter() -> None:
        child = subprocess.Popen(start.argv)
        started.append(child)
        cmdline = Path(f"/proc/{child.pid}/cmdline")
        while not cmdline.read_bytes().startswith(b"sleep\0"):
            threading.Event().wait(0.01)

    thread = threading.Thread(target=starter)
    thread.start()
    thread.join()
    try:
        assert started[0].wait(timeout=30) == -signal.SIGTERM
    finally:
        started[0].kill()
        started[0].wait()


def test_without_the_tools_it_falls_back_to_a_forking_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where setpriv and prlimit are missing (an empty PATH here), the limits and the signal
    are set by a preexec_fn, which forks; a user change is refused rather than forked."""
    monkeypatch.setenv("PATH", str(tmp_path))
    start = child_start(
        [sys.executable, "-c", CHILD_REPORT],
        death_signal=signal.SIGHUP,
        rlimits={resource.RLIMIT_CPU: (5, 6), resource.RLIMIT_CORE: (0, 0)},
    )
    assert start.forks and start.argv[0] == sys.executable
    run = subprocess.run(start.argv, capture_output=True, check=True, preexec_fn=start.preexec_fn)
    report = json.loads(run.stdout)
    assert report["death"] == signal.SIGHUP
    assert (report["cpu"], report["core"]) == (["5", "6"], ["0", "0"])
    with pytest.raises(RuntimeError, match="setpriv"):
        child_start(["/bin/true"], user=(65534, 65534))


def test_a_resource_prlimit_cannot_set_is_refused() -> None:
    with pytest.raises(ValueError, match="prlimit"):
        child_start(["/bin/true"], rlimits={resource.RLIMIT_RTTIME: (1, 1)})
