"""The data path's wire format: length-prefixed frames of the evald.v1 protobuf messages.

A frame is a 5-byte header, the payload length (unsigned 32-bit, big-endian) and a
:class:`Kind` byte, then the payload. A connection starts with one ``HELLO`` from the client
(:data:`HELLO_MAGIC` then the bearer token, possibly empty) and one ``READY`` or ``ERROR`` from
the daemon; then the client sends ``BATCH`` frames (an ``EvaluateBatchRequest`` each) and the
daemon answers with ``RESULTS`` frames (an ``EvaluateBatchResponse`` each, results in completion
order, matched by id), exactly as the messages of ``EvaluateStream``. A call-level failure is one
``ERROR`` frame (an ``evald.v1.Error``: the code and a message), after which the daemon closes
the connection. docs/data-path.md describes the protocol for other clients.

Both ends bound what they read before reading it: the header is read first and a length over
the limit ends the connection without reading the payload.
"""

from __future__ import annotations

import enum
import select
import socket
import struct
import threading
from collections.abc import Callable
from typing import Final

from evald.contract._errors import ErrorCode

__all__ = [
    "HEADER",
    "HELLO_MAGIC",
    "MAX_HELLO_BYTES",
    "FrameError",
    "FrameWriter",
    "Kind",
    "WriterStalled",
    "encode_frame",
    "read_frame",
]

HEADER: Final = struct.Struct("!IB")
#: The first bytes of every HELLO payload: the protocol and its version.
HELLO_MAGIC: Final = b"evald-data/1\n"
#: The most a HELLO (magic and token) may be: all a connection may send before authenticating.
MAX_HELLO_BYTES: Final = 1024


class Kind(enum.IntEnum):
    """What a frame carries."""

    HELLO = 1  # client: HELLO_MAGIC + token (UTF-8, may be empty on the unix socket)
    READY = 2  # daemon: authenticated; payload the tenant's name
    BATCH = 3  # client: evald.v1.EvaluateBatchRequest
    RESULTS = 4  # daemon: evald.v1.EvaluateBatchResponse
    ERROR = 5  # daemon: evald.v1.Error, then the connection closes


class FrameError(Exception):
    """A frame that breaks the protocol; ``code`` is what the peer is told."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def encode_frame(kind: Kind, payload: bytes) -> bytes:
    """The bytes of one frame."""
    return HEADER.pack(len(payload), kind) + payload


def read_frame(read: Callable[[int], bytes], max_payload_bytes: int) -> tuple[Kind, bytes] | None:
    """Reads one frame with ``read`` (a buffered file's: it returns fewer bytes only at the end
    of the stream); None at a clean end of stream (before a header).

    Raises:
        FrameError: the payload is over ``max_payload_bytes`` (nothing more is read), the kind
            is unknown, or the stream ends inside a frame.
        OSError: the socket failed (or timed out).
    """
    header = read(HEADER.size)
    if not header:
        return None
    if len(header) < HEADER.size:
        raise FrameError(ErrorCode.INVALID_ARGUMENT, "the connection ended inside a frame header")
    length, kind = HEADER.unpack(header)
    if length > max_payload_bytes:
        raise FrameError(
            ErrorCode.INVALID_ARGUMENT,
            f"a frame of {length} bytes is over this connection's limit of "
            f"{max_payload_bytes} bytes; split the batch",
        )
    try:
        known = Kind(kind)
    except ValueError:
        raise FrameError(
            ErrorCode.INVALID_ARGUMENT,
            f"unknown frame kind {kind}; this daemon speaks {HELLO_MAGIC.strip().decode()}",
        ) from None
    payload = read(length) if length else b""
    if len(payload) < length:
        raise FrameError(ErrorCode.INVALID_ARGUMENT, "the connection ended inside a frame")
    return known, payload


class WriterStalled(OSError):
    """The peer took no bytes for the writer's ``stall_s`` while frames waited for it."""


class FrameWriter:
    """Sends frames on one socket from any thread without blocking the caller.

    A frame goes out at once with a non-blocking send when nothing is queued before it (the
    usual case: the peer reads). Whatever the socket buffer cannot take waits, in order, for a
    writer thread (started on first need) that sends it as the peer reads. So a peer that stops
    reading holds up only this connection's writer, never the thread that produced the frame.

    A frame may carry a ``credit`` (the daemon: the output bytes reserved for its results),
    handed to ``on_sent`` once the frame is in the socket buffer, so what the writer queues is
    counted until it leaves. With ``stall_s``, a peer that takes no byte for that long while
    frames wait fails the writer with :class:`WriterStalled` (its queue is dropped, its credits
    returned, ``on_failed`` told).

    The socket must have no timeout while the writer lives (readers keep their deadlines with
    ``poll``): Python applies a socket object's timeout to every send on it, so a read's
    timeout would make this writer's sends wait, then fail with ``TimeoutError``.
    """

    def __init__(
        self,
        sock: socket.socket,
        name: str,
        *,
        stall_s: float | None = None,
        on_sent: Callable[[int], None] | None = None,
        on_failed: Callable[[OSError], None] | None = None,
    ) -> None:
        self._sock = sock
        self._name = name
        self._stall_ms = -1 if stall_s is None else max(1, int(stall_s * 1000))
        self._on_sent = on_sent
        self._on_failed = on_failed
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending = bytearray()
        self._credit = 0  # credits of the frames in _pending
        self._writing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.failed: OSError | None = None

    @property
    def queued_bytes(self) -> int:
        """Bytes waiting for the writer thread (0 when the peer keeps up)."""
        return len(self._pending)

    def send(self, frame: bytes, credit: int = 0) -> None:
        """Queues ``frame`` after every frame sent before it; never blocks on the peer.

        Raises:
            ConnectionError: the writer is closed or the socket failed earlier (``credit`` is
                not taken: the caller still owns it).
        """
        with self._lock:
            if self._closed or self.failed is not None:
                raise ConnectionError(f"{self._name}: the connection is closed")
            if not self._pending and not self._writing:
                try:
                    sent = self._sock.send(frame, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:
                    self.failed = exc
                    raise ConnectionError(f"{self._name}: {exc}") from exc
                if sent == len(frame):
                    frame = b""
                else:
                    frame = frame[sent:]
            if frame:
                self._pending += frame
                self._credit += credit
                credit = 0
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._wake.notify()
        self._release(credit)

    def _release(self, credit: int) -> None:
        if credit and self._on_sent is not None:
            self._on_sent(credit)

    def _send_all(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLOUT)
        while view:
            try:
                sent = self._sock.send(view, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            if sent:
                view = view[sent:]
            elif not poller.poll(self._stall_ms):
                raise WriterStalled(
                    f"{self._name}: the peer read nothing for {self._stall_ms / 1000:g} s "
                    f"while {len(view) + len(self._pending)} bytes waited"
                )

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    return
                chunk = bytes(self._pending)
                self._pending.clear()
                credit, self._credit = self._credit, 0
                self._writing = True
            try:
                self._send_all(chunk)
            except OSError as exc:
                with self._lock:
                    self.failed = exc
                    self._writing = False
                    self._pending.clear()
                    credit += self._credit
                    self._credit = 0
                self._release(credit)
                if self._on_failed is not None:
                    self._on_failed(exc)
                return
            with self._lock:
                self._writing = False
            self._release(credit)

    def close(self, timeout_s: float = 0.0) -> None:
        """Stops accepting frames; waits up to ``timeout_s`` for queued ones to go out."""
        with self._lock:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None and timeout_s > 0 and thread is not threading.current_thread():
            thread.join(timeout_s)
