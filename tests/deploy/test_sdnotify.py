"""The systemd readiness notice, against a real datagram socket standing in for the manager."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from evald.daemon import _sdnotify


@pytest.fixture
def manager_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A bound datagram socket at a short path (sun_path is 108 bytes), named in NOTIFY_SOCKET."""
    with tempfile.TemporaryDirectory(prefix="sdn") as folder:
        path = str(Path(folder) / "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(2.0)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        try:
            yield sock
        finally:
            sock.close()


def test_ready_sends_one_datagram_with_status(manager_socket: socket.socket) -> None:
    assert _sdnotify.notify_ready("serving on\nunix:/run/evald/evald.sock")
    message = manager_socket.recv(4096).decode()
    # The newline inside the status is folded: it would otherwise start a new assignment.
    assert message == "READY=1\nSTATUS=serving on unix:/run/evald/evald.sock"


def test_stopping_and_status(manager_socket: socket.socket) -> None:
    assert _sdnotify.notify_stopping("draining 3 calls")
    assert manager_socket.recv(4096) == b"STOPPING=1\nSTATUS=draining 3 calls"
    assert _sdnotify.notify_status("2 tenants")
    assert manager_socket.recv(4096) == b"STATUS=2 tenants"


def test_abstract_namespace_address(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"evald-sdnotify-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2.0)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert _sdnotify.notify_ready()
        assert sock.recv(4096) == b"READY=1"


def test_outside_systemd_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not _sdnotify.notify_ready("x")


@pytest.mark.parametrize("value", ["vsock:2:1234", "relative/path"])
def test_unsupported_address_is_ignored(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert not _sdnotify.notify_ready()


def test_unreachable_manager_never_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert not _sdnotify.notify_ready()
