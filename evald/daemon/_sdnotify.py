"""Readiness and shutdown notices for systemd's ``Type=notify`` services, without a dependency.

The unit in ``deploy/systemd/evald.service`` is ``Type=notify``: systemd holds back every unit
ordered after evald (an SGLang unit, for example) until the daemon says ``READY=1``, which it does
only once the gRPC server is bound and serving, so clients never race a socket that is not there
yet. ``STOPPING=1`` tells systemd that a drain has begun (SIGTERM), so ``systemctl status`` shows
it.

The protocol is one datagram of ``KEY=VALUE`` lines to the unix socket named by
``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace). Outside systemd the variable
is unset and every function here does nothing and returns False, so callers need no checks.
"""

from __future__ import annotations

import os
import socket

__all__ = ["notify", "notify_ready", "notify_status", "notify_stopping"]

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"


def _address(raw: str) -> str | None:
    """The ``connect`` address for ``$NOTIFY_SOCKET``, or None when it is not a unix socket.

    ``@name`` is the abstract namespace (a leading NUL byte). systemd may also hand out
    ``vsock:`` addresses (inside VMs); those are not supported and are ignored.
    """
    if raw.startswith("@"):
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None


def notify(state: str) -> bool:
    """Sends ``state`` (newline-separated ``KEY=VALUE`` assignments) to the service manager.

    Parameters:
        state: for example ``"READY=1\\nSTATUS=serving"``.

    Returns:
        True if the datagram was sent; False when not running under a notify-aware manager or
        when the socket cannot be reached. Never raises: a failed notice must not stop a daemon
        that otherwise works (systemd then reports the start as timed out, which is visible).
    """
    raw = os.environ.get(NOTIFY_SOCKET_ENV, "")
    address = _address(raw) if raw else None
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode("utf-8"))
    except OSError:
        return False
    return True


def notify_ready(status: str = "") -> bool:
    """Says the daemon serves: call once, after the server has started listening.

    Parameters:
        status: a one-line human-readable status shown by ``systemctl status``
            (for example ``"serving on unix:/run/evald/evald.sock"``).
    """
    return notify("READY=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))


def notify_stopping(status: str = "") -> bool:
    """Says a graceful shutdown (drain of in-flight calls) has begun."""
    return notify("STOPPING=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))


def notify_status(status: str) -> bool:
    """Updates the status line only (for example a count of tenants after start-up)."""
    return notify(f"STATUS={_one_line(status)}")


def _one_line(text: str) -> str:
    """The protocol is line-based: a newline inside a value would start a new assignment."""
    return " ".join(text.split())
