"""The client end of the data path (:mod:`evald.daemon._data_path`): one connection, blocking reads.

Used by the engine's :class:`engine_adapter.EvaluatorClient` (when given a ``data_target``), by
the benchmarks and by tests. Sending never blocks on the daemon
(:class:`~evald.contract.FrameWriter`); :meth:`DataConnection.receive` blocks until the next
RESULTS frame.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from evald.contract import (
    CLIENT_MAX_MESSAGE_BYTES,
    HELLO_MAGIC,
    ErrorCode,
    FrameError,
    FrameWriter,
    Kind,
    encode_frame,
    pb,
    read_frame,
    unix_socket_path,
)

__all__ = ["DataCallError", "DataConnection"]


class DataCallError(Exception):
    """The daemon refused the connection or ended it with an ERROR frame (``code`` says why),
    or broke the protocol (``internal``)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


def _error(payload: bytes) -> DataCallError:
    try:
        error = pb.Error.FromString(payload)
        return DataCallError(ErrorCode.from_proto(int(error.code)), str(error.message))
    except Exception:  # a daemon that speaks something else
        return DataCallError(ErrorCode.INTERNAL, "the daemon sent an unreadable ERROR frame")


class DataConnection:
    """One authenticated data-path connection. ``send`` from any thread; ``receive`` from one.

    Use :meth:`connect`.
    """

    def __init__(self, sock: socket.socket, reader: Any, tenant: str, max_frame_bytes: int) -> None:
        self._sock = sock
        self.tenant = tenant
        self._reader = reader
        self._writer = FrameWriter(sock, "evald-data-client-writer")
        self._max_frame_bytes = max_frame_bytes

    @classmethod
    def connect(
        cls,
        target: str,
        token: str | None = None,
        *,
        timeout_s: float = 2.0,
        max_frame_bytes: int = CLIENT_MAX_MESSAGE_BYTES,
    ) -> DataConnection:
        """Connects to ``unix:PATH`` and authenticates with ``token`` (none: the unix socket's
        tokenless tenant). ``max_frame_bytes`` bounds a RESULTS frame; a frame carries one
        message, so the default is the gRPC client's message limit.

        Raises:
            DataCallError: the daemon refused (``permission_denied``, ``unavailable`` …).
            OSError: nothing listens there, or the connection broke.
        """
        path = unix_socket_path(target)
        if path is None:
            raise DataCallError(
                ErrorCode.INVALID_ARGUMENT, f"the data path is a unix socket (unix:PATH): {target}"
            )
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(str(path))
            hello = HELLO_MAGIC + (token or "").encode("utf-8")
            try:
                sock.sendall(encode_frame(Kind.HELLO, hello))
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before reading (too many connections): its ERROR is waiting
            reader = sock.makefile("rb", buffering=256 * 1024)
            try:
                frame = read_frame(reader.read, max_frame_bytes)
            except FrameError as exc:
                raise DataCallError(ErrorCode.INTERNAL, exc.message) from None
            if frame is None:
                raise ConnectionError(f"the daemon at {target} closed the connection")
            kind, payload = frame
            if kind is Kind.ERROR:
                raise _error(payload)
            if kind is not Kind.READY:
                raise DataCallError(ErrorCode.INTERNAL, f"expected READY, got {kind.name}")
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return cls(sock, reader, payload.decode("utf-8", errors="replace"), max_frame_bytes)

    def send(self, request: pb.EvaluateBatchRequest) -> None:
        """Queues one message (never blocks on the daemon).

        Raises:
            ConnectionError: the connection is closed or broke.
        """
        self._writer.send(encode_frame(Kind.BATCH, request.SerializeToString()))

    def receive(self) -> pb.EvaluateBatchResponse | None:
        """The next results (completion order); None when the daemon closed cleanly.

        Raises:
            DataCallError: the daemon ended the connection with an error.
            OSError: the connection broke.
        """
        try:
            frame = read_frame(self._reader.read, self._max_frame_bytes)
        except FrameError as exc:
            raise DataCallError(ErrorCode.INTERNAL, exc.message) from None
        if frame is None:
            return None
        kind, payload = frame
        if kind is Kind.RESULTS:
            return pb.EvaluateBatchResponse.FromString(payload)
        if kind is Kind.ERROR:
            raise _error(payload)
        raise DataCallError(ErrorCode.INTERNAL, f"expected RESULTS, got {kind.name}")

    def done_sending(self) -> None:
        """Tells the daemon no more messages come; it answers what it holds, then closes."""
        self._writer.close(timeout_s=5.0)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """Closes at once (a blocked :meth:`receive` returns or raises)."""
        self._writer.close()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._reader.close()
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> DataConnection:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
