"""Reading a data-path connection's frames under the daemon's bounds in time and bytes.

Why not a buffered file: a frame's header says how many bytes follow, and the daemon must act
between the two: charge them to the sender's budget before reading them, and give the rest of
the frame a deadline. A peer that sends the header of an 8 MiB frame and then all but one byte
would otherwise hold those bytes for as long as it keeps the connection open (64 such
connections held 526 MiB). A buffered file cannot be read with a timeout without losing its
place, so this reader keeps its own small buffer over ``recv_into``:

* :meth:`FrameReader.next_header` waits for the next header, as long as the connection is busy,
  or at most ``idle_timeout_s`` while nothing is in flight (then :class:`Idle`);
* :meth:`FrameReader.payload` reads the frame's payload within ``frame_timeout_s`` of its header.

Deadlines are kept with ``poll`` and non-blocking reads (:func:`recv_within`), never with the
socket's timeout: the connection's writer thread sends on the same socket object, and a timeout
set for a read makes its sends wait and fail with ``TimeoutError`` (a connection whose client had
stopped reading ended as if its HELLO had never come, instead of being cut off for it).
"""

from __future__ import annotations

import math
import select
import socket
import time
from collections.abc import Callable
from typing import Final

from evald.contract import HEADER, HELLO_MAGIC, ErrorCode, FrameError, Kind

__all__ = ["FrameReader", "Idle", "recv_within"]

_CHUNK_BYTES: Final = 256 * 1024


class Idle(Exception):
    """Nothing arrived for ``idle_timeout_s`` while nothing was in flight."""


class FrameReader:
    """One connection's frames, read from ``sock`` (blocking mode) on the reader thread.

    Parameters:
        max_payload_bytes: the longest payload accepted (longer ends the connection unread).
        frame_timeout_s: how long a payload may take once its header has arrived.
    """

    def __init__(self, sock: socket.socket, max_payload_bytes: int, frame_timeout_s: float):
        self._sock = sock
        self._max_payload = max_payload_bytes
        self._frame_timeout_s = frame_timeout_s
        self._buffer = bytearray()

    def next_header(
        self, idle_timeout_s: float, busy: Callable[[], bool]
    ) -> tuple[Kind, int] | None:
        """The next frame's kind and payload length; None when the peer is done sending.

        Raises:
            Idle: nothing arrived for ``idle_timeout_s`` (> 0) while ``busy()`` was false.
            FrameError: a length over the limit or an unknown kind (nothing more is read).
            OSError: the socket failed.
        """
        while len(self._buffer) < HEADER.size:
            if idle_timeout_s > 0 and not self._readable_within(idle_timeout_s):
                if busy():
                    continue  # results still owed: the client is waiting for them
                raise Idle
            if not self._fill():
                if self._buffer:
                    raise FrameError(
                        ErrorCode.INVALID_ARGUMENT, "the connection ended inside a frame header"
                    )
                return None
        length, kind = HEADER.unpack_from(self._buffer)
        del self._buffer[: HEADER.size]
        if length > self._max_payload:
            raise FrameError(
                ErrorCode.INVALID_ARGUMENT,
                f"a frame of {length} bytes is over this connection's limit of "
                f"{self._max_payload} bytes; split the batch",
            )
        try:
            return Kind(kind), length
        except ValueError:
            raise FrameError(
                ErrorCode.INVALID_ARGUMENT,
                f"unknown frame kind {kind}; this daemon speaks {HELLO_MAGIC.strip().decode()}",
            ) from None

    def payload(self, length: int) -> bytes:
        """The ``length`` bytes after a header, within ``frame_timeout_s`` from now.

        Raises:
            FrameError: ``quota_exceeded`` when they do not arrive in time; ``invalid_argument``
                when the connection ends first.
            OSError: the socket failed.
        """
        if len(self._buffer) >= length:  # the usual case: small frames, read in one go
            whole = bytes(self._buffer[:length])
            del self._buffer[:length]
            return whole
        payload = bytearray(length)
        view = memoryview(payload)
        taken = min(length, len(self._buffer))
        view[:taken] = self._buffer[:taken]
        del self._buffer[:taken]
        deadline = time.monotonic() + self._frame_timeout_s
        try:
            while taken < length:
                chunk = recv_within(
                    self._sock, min(length - taken, _CHUNK_BYTES), deadline - time.monotonic()
                )
                if not chunk:
                    raise FrameError(
                        ErrorCode.INVALID_ARGUMENT, "the connection ended inside a frame"
                    )
                view[taken : taken + len(chunk)] = chunk
                taken += len(chunk)
        except TimeoutError:
            raise FrameError(
                ErrorCode.QUOTA_EXCEEDED,
                f"a frame of {length} bytes did not arrive whole within "
                f"{self._frame_timeout_s:g} s of its header (frame_timeout_s); send each "
                "frame at once",
            ) from None
        return bytes(payload)

    def _readable_within(self, timeout_s: float) -> bool:
        return _readable(self._sock, timeout_s)

    def _fill(self) -> bool:
        """Reads what has arrived (at most one chunk, waiting for it) into the buffer; False at
        end of stream."""
        chunk = self._sock.recv(_CHUNK_BYTES)  # the socket stays blocking: see the module doc
        if not chunk:
            return False
        self._buffer += chunk
        return True


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0, math.ceil(timeout_s * 1000))))


def recv_within(sock: socket.socket, size: int, timeout_s: float) -> bytes:
    """At most ``size`` bytes that arrive within ``timeout_s``; ``b""`` at end of stream.

    Leaves the socket's own timeout alone (see the module doc).

    Raises:
        TimeoutError: nothing arrived in time.
        OSError: the socket failed.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not _readable(sock, left):
            raise TimeoutError
        try:
            return sock.recv(size, socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue  # woken without data (another reader's wake-up): wait again
