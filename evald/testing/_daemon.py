"""Runs ``evald serve`` as a child process on a real unix socket, and watches it.

Whoever tests something against evald needs a real daemon they can start, health-check, measure
(RSS from ``/proc``), kill -9 and restart on the same state folder: evald's own tests, the
engine adapters' real-server tests, ``evald fuzz`` and the benchmarks, and an operator's
integration tests of their engine. This module is that one piece, so none of them copies it.
:func:`start_daemon` writes a config file, starts the daemon, waits until its health service
says SERVING and returns a :class:`DaemonProcess`; the daemon's JSON-lines log goes to a file
the handle can read back. Nothing here talks to the daemon other than through its public API.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from evald.contract import append_custom_section
from evald.daemon import ParentLink

__all__ = [
    "EVALD",
    "START_TIMEOUT_S",
    "DaemonProcess",
    "evald_command",
    "free_port",
    "padded",
    "process_alive",
    "process_cpu_s",
    "process_descendants",
    "process_rss_bytes",
    "start_daemon",
    "wait_serving",
]

#: The ``evald`` console script next to this interpreter (what a user runs).
EVALD = str(Path(sys.executable).with_name("evald"))
START_TIMEOUT_S = 60.0

_D = TypeVar("_D", bound="DaemonProcess")


def evald_command() -> list[str]:
    """The command that runs ``evald``: its console script, else ``python -m evald.cli``."""
    if Path(EVALD).exists():
        return [EVALD]
    return [sys.executable, "-m", "evald.cli"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listened on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid`` from ``/proc/PID/stat``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def process_descendants(pid: int) -> dict[int, str]:
    """Every live process below ``pid`` (children, theirs, …): pid -> command line.

    Taken before a process is killed, it names what must end with it: an orphan is re-parented
    and can no longer be found from the pid it came from.
    """
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(stat[1], []).append(int(entry))
    found: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                found[child] = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        todo.extend(children.get(child, []))
    return found


def process_rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` from ``/proc/PID/status`` (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_cpu_s(pid: int) -> float | None:
    """CPU time ``pid`` has used so far, all its threads, user and system, from
    ``/proc/PID/stat`` (None when it is gone): what a process took of the machine, whoever
    else ran."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class DaemonProcess:
    """A running ``evald serve`` child process and the files it uses."""

    process: subprocess.Popen[bytes]
    socket_path: Path
    state_dir: Path
    config_path: Path
    log_path: Path
    metrics_port: int | None = None
    #: The pipe that ties the daemon's life to this process (``evald serve --parent-fd``).
    parent_link: ParentLink | None = None

    @property
    def target(self) -> str:
        return f"unix:{self.socket_path}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_lines(self) -> list[dict[str, Any]]:
        """The daemon's structured log so far (lines that are not JSON are skipped)."""
        lines: list[dict[str, Any]] = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
        return lines

    def alive(self) -> bool:
        return self.process.poll() is None

    def rss_bytes(self) -> int | None:
        """The daemon's resident set size now (None once it has exited)."""
        return process_rss_bytes(self.process.pid) if self.alive() else None

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Signals the daemon and waits for it; returns its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
        status = self.process.wait(timeout=timeout_s)
        if self.parent_link is not None:
            self.parent_link.close()
        return status

    def kill(self) -> None:
        """kill -9: no drain, no clean-up (the socket file and the lock stay behind)."""
        self.stop(signal.SIGKILL)


def start_daemon(
    root: Path,
    config_text: str,
    *,
    state_dir: Path | None = None,
    socket_path: Path | None = None,
    listen: str | None = None,
    metrics_port: int | None = None,
    prefix: Sequence[str] = (),
    wait: bool = True,
    extra_args: Sequence[str] = (),
    tls_ca: Path | None = None,
    factory: Callable[..., _D] = DaemonProcess,  # type: ignore[assignment]
    start_timeout_s: float = START_TIMEOUT_S,
    own_session: bool = False,
) -> _D:
    """Starts ``evald serve`` with ``config_text`` (written to ``root/evald.toml``).

    Parameters:
        root: a folder for the config, the log and (by default) the socket and state.
        prefix: a command that runs the daemon (``["bash", "-c", 'ulimit -f 256 && exec
            "$0" "$@"']`` for example).
        wait: wait until the health service says SERVING.
        factory: the handle class (a subclass of :class:`DaemonProcess`).
        own_session: start it in a session of its own, as a service runs, so that it has a
            scheduling group of its own to lower while heavy work runs (docs/design.md, "Heavy
            work yields the CPU"); else it shares this process's.

    Raises:
        RuntimeError: the daemon exited or did not become healthy in ``start_timeout_s``
            (the message carries its log).
    """
    root.mkdir(parents=True, exist_ok=True)
    config_path = root / "evald.toml"
    config_path.write_text(config_text)
    socket_path = socket_path or root / "evald.sock"
    state_dir = state_dir or root / "state"
    log_path = root / f"daemon-{time.monotonic_ns()}.log"
    # The daemon dies with this process, however it dies (see evald.daemon._parent_watch).
    link = ParentLink()
    try:
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    *prefix,
                    *evald_command(),
                    "serve",
                    "--config",
                    str(config_path),
                    "--listen",
                    listen or f"unix:{socket_path}",
                    "--state-dir",
                    str(state_dir),
                    *link.child_args(),
                    *extra_args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=link.pass_fds,
                start_new_session=own_session,
            )
    except BaseException:
        link.close()
        raise
    link.spawned()
    daemon = factory(process, socket_path, state_dir, config_path, log_path, metrics_port, link)
    if wait:
        wait_serving(daemon, listen, tls_ca=tls_ca, timeout_s=start_timeout_s)
    return daemon


def wait_serving(
    daemon: DaemonProcess,
    listen: str | None = None,
    tls_ca: Path | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> None:
    """Waits until the daemon's health service says SERVING.

    Raises:
        RuntimeError: the daemon exited, or was not healthy in ``timeout_s`` (it is killed).
    """
    from evald.client import CallError, Client

    give_up = time.monotonic() + timeout_s
    with Client(listen or daemon.target, timeout_s=2.0, tls_ca=tls_ca) as client:
        while True:
            if daemon.process.poll() is not None:
                raise RuntimeError(
                    f"evald serve exited with {daemon.process.returncode}:\n"
                    + daemon.log_path.read_text(errors="replace")
                )
            try:
                if client.health() == "SERVING":
                    return
            except CallError:
                pass
            if time.monotonic() > give_up:
                daemon.process.kill()
                daemon.process.wait()
                raise RuntimeError(
                    "evald serve did not become healthy:\n"
                    + daemon.log_path.read_text(errors="replace")
                )
            time.sleep(0.05)


def padded(wasm: bytes, total_bytes: int) -> bytes:
    """``wasm`` with a custom section that makes it exactly ``total_bytes`` long.

    Raises:
        ValueError: ``total_bytes`` cannot be reached (smaller than the module plus a section).
    """
    for name in ("pad", "pad_"):  # a longer name steps over a LEB128 length boundary
        estimate = total_bytes - len(wasm) - len(name) - 6
        for payload_bytes in range(max(0, estimate - 8), estimate + 8):
            candidate = append_custom_section(wasm, name, b"\0" * payload_bytes)
            if len(candidate) == total_bytes:
                return candidate
    raise ValueError(f"cannot pad a {len(wasm)}-byte module to {total_bytes} bytes")
