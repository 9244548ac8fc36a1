"""The data path's frame reader keeps its deadlines without touching the socket's timeout.

The connection's writer thread sends on the same socket object while the reader waits for a
payload. A socket timeout set for that read made the writer's non-blocking sends wait and fail
with ``TimeoutError``: a connection whose client had stopped reading ended as if its HELLO had
never come, and was not cut off for it (one run in two beside two CPU hogs). Real sockets here,
a unix socket pair.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from evald.contract import HEADER, ErrorCode, FrameError, Kind
from evald.daemon._frame_reader import FrameReader, recv_within


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    daemon_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield daemon_end, client_end
    daemon_end.close()
    client_end.close()


def _fill_send_buffer(sock: socket.socket) -> None:
    while True:
        try:
            sock.send(b"\0" * 65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return


def test_a_send_while_a_payload_is_awaited_does_not_wait(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    daemon_end, client_end = pair
    reader = FrameReader(daemon_end, 1 << 20, frame_timeout_s=30.0)
    client_end.sendall(HEADER.pack(100, Kind.BATCH.value) + b"x" * 10)  # 90 bytes to come
    assert reader.next_header(0, lambda: False) == (Kind.BATCH, 100)
    _fill_send_buffer(daemon_end)  # the client reads no results
    payload: list[bytes] = []
    waiting = threading.Thread(target=lambda: payload.append(reader.payload(100)))
    waiting.start()
    try:
        for _ in range(50):  # whenever the reader is in its wait, a send answers at once
            with pytest.raises(BlockingIOError):
                daemon_end.send(b"result", socket.MSG_DONTWAIT)
        assert daemon_end.gettimeout() is None
    finally:
        client_end.sendall(b"y" * 90)
        waiting.join(timeout=30)
    assert payload == [b"x" * 10 + b"y" * 90]


def test_a_payload_that_does_not_arrive_in_time_is_quota_exceeded(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    daemon_end, client_end = pair
    reader = FrameReader(daemon_end, 1 << 20, frame_timeout_s=0.2)
    client_end.sendall(HEADER.pack(100, Kind.BATCH.value) + b"x" * 10)
    assert reader.next_header(0, lambda: False) == (Kind.BATCH, 100)
    with pytest.raises(FrameError) as late:
        reader.payload(100)
    assert late.value.code is ErrorCode.QUOTA_EXCEEDED
    assert "within 0.2 s of its header (frame_timeout_s)" in late.value.message
    assert daemon_end.gettimeout() is None


def test_recv_within_reads_what_came_times_out_and_sees_the_end(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    daemon_end, client_end = pair
    client_end.sendall(b"hello")
    assert recv_within(daemon_end, 1024, 5.0) == b"hello"
    with pytest.raises(TimeoutError):
        recv_within(daemon_end, 1024, 0.05)
    client_end.shutdown(socket.SHUT_WR)
    assert recv_within(daemon_end, 1024, 5.0) == b""
    assert daemon_end.gettimeout() is None
