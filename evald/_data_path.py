"""The engine data path: ``EvaluateStream``'s messages as length-prefixed frames on a unix socket.

Why a second transport: on the engine's path a gRPC message costs far more than the evaluation
it carries (HTTP/2 framing, the asyncio loop, thread hand-offs: hundreds of microseconds for a
few microseconds of guest time), while a length-prefixed protobuf over a unix socket costs tens.
So ``[server] data_listen`` opens a unix socket that carries exactly the messages of
``EvaluateStream`` in the frames of :mod:`evald._frames`; gRPC stays the control plane (listing,
registration, health) and the only TCP/TLS transport.

It is the same daemon behind another door, not a second implementation. A connection is
authenticated by :meth:`EvaldServer.authenticate` (its first frame, a HELLO of at most
:data:`~evald._frames.MAX_HELLO_BYTES`, carries the bearer token; nothing else is read before it
passes, and it must come within :data:`HELLO_TIMEOUT_S`); each item goes through
:meth:`EvaldServer.prepare` (evaluator resolution, quotas, rate) and the daemon's fair scheduler
(:meth:`EvaldServer.enqueue`: the same per-tenant queues, ``max_running`` caps and round-robin
as gRPC calls, on the same worker threads); evaluation errors are the same ``EvaluateResponse``
values, call-level errors the same codes (an ERROR frame, then the connection closes).

Threads: one accepts; each connection has a reader thread (it blocks on its socket, so waiting
costs nothing and guest code never runs on it) and, when needed, a flusher and a writer. A
worker sends a result itself when it has finished the last item of a message it can take (one
non-blocking send: the common case costs no thread hand-off); results that finish while other
items of their message still run are sent by the flusher within :data:`COALESCE_S`, so one
slow item never holds back the fast ones. Backpressure: a connection has at most
``max_batch_items`` results outstanding; past that its reader stops reading, so a client that
sends without reading stalls itself (the socket buffer fills) and nobody else.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Final

from google.protobuf.message import DecodeError

from evald._errors import ErrorCode, EvaldError
from evald._frames import (
    HELLO_MAGIC,
    MAX_HELLO_BYTES,
    FrameError,
    FrameWriter,
    Kind,
    encode_frame,
    read_frame,
)
from evald.v1 import evald_pb2 as pb

if TYPE_CHECKING:
    from evald._server import EvaldServer, _Batch, _TenantState, _Work

__all__ = ["COALESCE_S", "HELLO_TIMEOUT_S", "METHOD", "DataServer", "unix_socket_path"]

_log = logging.getLogger("evald.data")

#: The method name the data path's connections are counted under in ``evald_rpcs``.
METHOD: Final = "DataStream"
#: A connection that has not sent its HELLO within this long is closed.
HELLO_TIMEOUT_S: Final = 5.0
#: How long a finished result may wait for others of its burst before the flusher sends it.
COALESCE_S: Final = 0.0002
_READ_BUFFER_BYTES: Final = 256 * 1024


def unix_socket_path(target: str) -> Path:
    """The file of a ``unix:PATH`` or ``unix:///PATH`` address, made absolute.

    Raises:
        EvaldError: ``invalid_argument`` when ``target`` is not a unix address.
    """
    if not target.startswith("unix:") or target.startswith("unix-abstract:"):
        raise EvaldError(ErrorCode.INVALID_ARGUMENT, f"expected unix:PATH, got {target!r}")
    raw = target[len("unix:") :]
    if raw.startswith("//"):
        raw = raw[2:]
    return Path(raw).expanduser().absolute()


class _HelloContext:
    """What :meth:`EvaldServer.authenticate` asks of a call, answered from a HELLO frame."""

    def __init__(self, token: str, peer: str) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._peer = peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer


def _error_frame(code: ErrorCode, message: str) -> bytes:
    error = pb.Error(code=code.proto_value, message=message)  # type: ignore[arg-type]
    return encode_frame(Kind.ERROR, error.SerializeToString())


class _Connection:
    """One data-path connection: its reader thread's loop and the results it owes."""

    def __init__(self, server: DataServer, sock: socket.socket, number: int) -> None:
        self._server = server
        self._daemon = server.daemon
        self._sock = sock
        self._name = f"evald-data-{number}"
        self._reader = sock.makefile("rb", buffering=_READ_BUFFER_BYTES)
        self._writer = FrameWriter(sock, f"{self._name}-writer")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # outstanding fell, or closed
        self._flush_wake = threading.Condition(self._lock)
        self._results: list[pb.EvaluateResponse] = []
        self._outstanding = 0
        self._live: dict[int, _Batch] = {}  # batches with items not yet answered, by id()
        self._flusher: threading.Thread | None = None
        self._closed = False
        self._aborted = False  # the daemon's grace ran out: stop waiting for results
        self._backlog_limit = self._daemon.config.server.max_batch_items
        self._max_frame = self._daemon.config.server.max_message_bytes
        self.thread = threading.Thread(target=self._serve, name=self._name, daemon=True)

    # -- the reader thread ---------------------------------------------------------------

    def _serve(self) -> None:
        daemon = self._daemon
        tenant_label = "unauthenticated"
        code = "ok"
        failure: tuple[ErrorCode, str] | None = None
        authenticated = False
        try:
            tenant = self._hello()
            tenant_label = tenant.name
            authenticated = True
            self._writer.send(encode_frame(Kind.READY, tenant.name.encode("utf-8")))
            while not daemon.stopping:
                if self._writer.failed is not None:
                    raise self._writer.failed  # the peer is gone: what it sent is moot
                frame = read_frame(self._reader.read, self._max_frame)
                if frame is None:
                    break  # the client is done sending: answer what it sent, then close
                kind, payload = frame
                if kind is not Kind.BATCH:
                    raise FrameError(
                        ErrorCode.INVALID_ARGUMENT,
                        f"expected a BATCH frame, got {kind.name}; HELLO comes once, first",
                    )
                self._submit(tenant, payload)
            if daemon.stopping:
                failure = (
                    ErrorCode.UNAVAILABLE,
                    "the daemon is shutting down; reconnect to another",
                )
        except (FrameError, EvaldError) as exc:
            failure = (exc.code, exc.message)
        except TimeoutError:
            failure = (
                ErrorCode.PERMISSION_DENIED,
                f"no HELLO frame within {HELLO_TIMEOUT_S:g} s; a connection authenticates first",
            )
        except OSError:
            code = "cancelled"  # the peer went away: nobody to answer
            authenticated = False
        except Exception:
            _log.exception("data connection failed", extra={"fields": {"tenant": tenant_label}})
            failure = (ErrorCode.INTERNAL, "internal error in the daemon (see its log)")
        finally:
            if failure is not None:
                code = failure[0].value
                _log.info(
                    "call refused",
                    extra={
                        "fields": {
                            "method": METHOD,
                            "tenant": tenant_label,
                            "code": code,
                            "error": failure[1],
                        }
                    },
                )
            self._finish(failure, authenticated)
            daemon.metrics.observe_rpc(METHOD, tenant_label, code)
            self._server.forget(self)

    def _hello(self) -> _TenantState:
        # One deadline for the whole HELLO (a timer, not a per-read timeout: a client sending a
        # byte every few seconds must not hold the connection open).
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            self.shut_reading()

        timer = threading.Timer(HELLO_TIMEOUT_S, expire)
        timer.daemon = True
        timer.start()
        try:
            frame = read_frame(self._reader.read, MAX_HELLO_BYTES)
        except (FrameError, OSError):
            if expired.is_set():
                raise TimeoutError from None
            raise
        finally:
            timer.cancel()
        if expired.is_set():
            raise TimeoutError
        if frame is None:
            raise OSError("closed before HELLO")
        kind, payload = frame
        if kind is not Kind.HELLO or not payload.startswith(HELLO_MAGIC):
            raise FrameError(
                ErrorCode.INVALID_ARGUMENT,
                f"the first frame must be a HELLO starting {HELLO_MAGIC!r} (docs/data-path.md)",
            )
        try:
            token = payload[len(HELLO_MAGIC) :].decode("utf-8").strip()
        except UnicodeDecodeError:
            raise EvaldError(ErrorCode.PERMISSION_DENIED, "the token is not UTF-8") from None
        return self._daemon.authenticate(_HelloContext(token, f"unix:{self._server.path}"))

    def _submit(self, tenant: _TenantState, payload: bytes) -> None:
        from evald._server import _Batch

        daemon = self._daemon
        try:
            message = pb.EvaluateBatchRequest.FromString(payload)
        except DecodeError:
            raise FrameError(
                ErrorCode.INVALID_ARGUMENT,
                "a BATCH frame is not a valid evald.v1.EvaluateBatchRequest (corrupt protobuf, "
                "or a string field that is not UTF-8)",
            ) from None
        items = message.items
        daemon.check_batch_size(len(items))
        if not items:
            return
        with self._lock:
            while (
                self._outstanding >= self._backlog_limit
                and not daemon.stopping
                and self._writer.failed is None
            ):
                self._changed.wait(0.5)
            self._outstanding += len(items)
        queue: collections.deque[_Work] = collections.deque()
        refused: list[pb.EvaluateResponse] = []
        for index, item in enumerate(items):
            prepared = daemon.prepare(tenant, item, index)
            if isinstance(prepared, pb.EvaluateResponse):
                refused.append(prepared)
            else:
                queue.append(prepared)
        if refused:
            with self._lock:
                self._results.extend(refused)
                send_now = not queue
                results = self._take_locked() if send_now else []
                if not send_now:
                    self._wake_flusher_locked()  # not after the admitted items' results
            if send_now:
                self._send(results)
        if not queue:
            return
        left = [len(queue)]

        def deliver(_work: _Work, response: pb.EvaluateResponse) -> None:
            with self._lock:
                if self._closed:
                    return
                results = self._results
                results.append(response)
                left[0] -= 1
                if not left[0]:
                    self._live.pop(id(queue), None)
                if not queue:  # nothing left to take: this worker sends the burst now
                    self._results = []
                else:
                    if len(results) == 1:
                        self._wake_flusher_locked()
                    return
            self._send(results)

        batch = _Batch(None, queue, deliver)
        with self._lock:
            self._live[id(queue)] = batch
        added, scheduled = daemon.enqueue(batch)
        if not scheduled:
            daemon.abandon(batch, added)

    # -- results ------------------------------------------------------------------------

    def _take_locked(self) -> list[pb.EvaluateResponse]:
        results, self._results = self._results, []
        return results

    def _send(self, results: list[pb.EvaluateResponse]) -> None:
        """Sends results as one frame (any thread) and counts them off the backlog."""
        if not results:
            return
        frame = encode_frame(
            Kind.RESULTS, pb.EvaluateBatchResponse(results=results).SerializeToString()
        )
        with contextlib.suppress(ConnectionError):  # the reader sees the peer gone
            self._writer.send(frame)
        with self._lock:
            self._outstanding -= len(results)
            self._changed.notify_all()

    def _wake_flusher_locked(self) -> None:
        if self._flusher is None:
            self._flusher = threading.Thread(
                target=self._flush_loop, name=f"{self._name}-flush", daemon=True
            )
            self._flusher.start()
        self._flush_wake.notify()

    def _flush_loop(self) -> None:
        while True:
            with self._lock:
                while not self._results and not self._closed:
                    self._flush_wake.wait()
                if self._closed:
                    return
            time.sleep(COALESCE_S)  # let the burst gather; a worker may send it first
            with self._lock:
                results = self._take_locked()
            self._send(results)

    # -- the end ------------------------------------------------------------------------

    def _finish(self, failure: tuple[ErrorCode, str] | None, authenticated: bool) -> None:
        """Answers what was admitted (unless the peer left), sends the error, closes."""
        daemon = self._daemon
        if authenticated:  # every admitted item ends within its deadline
            with self._lock:
                while self._outstanding > 0 and self._writer.failed is None and not self._aborted:
                    self._changed.wait(0.5)
        with self._lock:
            self._closed = True
            live = list(self._live.values())
            self._live.clear()
            self._flush_wake.notify_all()
            self._changed.notify_all()
        for batch in live:
            daemon.abandon(batch, True)
        if failure is not None:
            with contextlib.suppress(ConnectionError):
                self._writer.send(_error_frame(*failure))
        self._writer.close(timeout_s=1.0)
        self.close_socket()

    def abort(self) -> None:
        """Stops waiting for results still running (the daemon's grace ran out)."""
        with self._lock:
            self._aborted = True
            self._changed.notify_all()

    def shut_reading(self) -> None:
        """Wakes the reader (daemon shutdown): it stops reading and answers what it holds."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RD)

    def close_socket(self) -> None:
        with contextlib.suppress(OSError):
            self._reader.close()
        with contextlib.suppress(OSError):
            self._sock.close()


class DataServer:
    """The data path's listener and connections, for one :class:`EvaldServer`."""

    def __init__(self, daemon: EvaldServer, target: str) -> None:
        self.daemon = daemon
        self.path = unix_socket_path(target)
        self._max_connections = daemon.config.server.data_max_connections
        self._listener: socket.socket | None = None
        self._connections: set[_Connection] = set()
        self._lock = threading.Lock()
        self._count = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def target(self) -> str:
        return f"unix:{self.path}"

    def start(self) -> None:
        """Binds the socket (created with ``socket_mode``) and starts accepting.

        Raises:
            EvaldError: the path is too long, not a socket, or another daemon serves it.
        """
        from evald._server import _check_unix_socket

        _check_unix_socket(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mode = self.daemon.config.server.socket_mode
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        previous = os.umask(0o777 & ~mode)  # no window in which others may connect
        try:
            listener.bind(str(self.path))
        except OSError as exc:
            listener.close()
            raise EvaldError(
                ErrorCode.UNAVAILABLE, f"cannot listen on {self.target}: {exc}"
            ) from None
        finally:
            os.umask(previous)
        os.chmod(self.path, mode)
        listener.listen(128)
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, name="evald-data-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                if self._stopping:
                    return
                time.sleep(0.05)  # out of descriptors: let some close
                continue
            with self._lock:
                if self._stopping:
                    sock.close()
                    return
                if len(self._connections) >= self._max_connections:
                    refuse = True
                else:
                    refuse = False
                    self._count += 1
                    connection = _Connection(self, sock, self._count)
                    self._connections.add(connection)
            if refuse:
                with contextlib.suppress(OSError):
                    sock.send(
                        _error_frame(
                            ErrorCode.UNAVAILABLE,
                            f"the data path already serves {self._max_connections} connections "
                            "(data_max_connections); retry later or share a connection",
                        ),
                        socket.MSG_DONTWAIT,
                    )
                sock.close()
                self.daemon.metrics.observe_rpc(
                    METHOD, "unauthenticated", ErrorCode.UNAVAILABLE.value
                )
                continue
            connection.thread.start()

    def forget(self, connection: _Connection) -> None:
        with self._lock:
            self._connections.discard(connection)

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._connections)

    def stop(self, grace_s: float) -> None:
        """Stops accepting; connections answer what they hold (at most ``grace_s``), get an
        ``unavailable`` ERROR and close. Blocking: run it off the event loop."""
        with self._lock:
            self._stopping = True
            connections = list(self._connections)
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for connection in connections:
            connection.shut_reading()
        give_up = time.monotonic() + max(0.0, grace_s)
        for connection in connections:
            connection.thread.join(max(0.0, give_up - time.monotonic()))
        for connection in connections:
            if connection.thread.is_alive():
                connection.abort()
                connection.close_socket()
                connection.thread.join(1.0)
        if self._thread is not None:
            self._thread.join(1.0)
        with contextlib.suppress(OSError):
            self.path.unlink()
