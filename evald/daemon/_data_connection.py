"""One data-path connection, served: its HELLO, its reader thread's loop, the results it owes.

Threads: each connection has a reader thread (it blocks on its socket, so waiting costs nothing
and guest code never runs on it) and, when needed, a flusher and a writer. A worker sends a
result itself when it has finished the last item of a message it can take (one non-blocking
send: the common case costs no thread hand-off); results that finish while other items of their
message still run are sent by the flusher within :data:`COALESCE_S`, so one slow item never
holds back the fast ones. The listener that accepts connections and the protocol as a whole are
:mod:`evald.daemon._data_path`'s.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Final

from google.protobuf.message import DecodeError

from evald.contract import (
    HELLO_MAGIC,
    MAX_HELLO_BYTES,
    ErrorCode,
    EvaldError,
    FrameError,
    FrameWriter,
    Kind,
    WriterStalled,
    encode_frame,
    pb,
    read_frame,
)
from evald.daemon._admission import Tenant
from evald.daemon._data_peers import Peer
from evald.daemon._frame_reader import FrameReader, Idle, recv_within
from evald.daemon._gatekeeping import pack_responses
from evald.daemon._scheduler import Batch, Work
from evald.daemon._transport import Core, Intake, OutputBudget, shutting_down

__all__ = ["COALESCE_S", "HELLO_TIMEOUT_S", "METHOD", "ServedConnection", "error_frame"]

_log = logging.getLogger("evald.data")

#: The method name the data path's connections are counted under in ``evald_rpcs``.
METHOD: Final = "DataStream"
#: A connection that has not sent its HELLO within this long is closed.
HELLO_TIMEOUT_S: Final = 5.0
#: A connection still without HELLO after this long may be closed to make room for a new one.
_CHUNK_BYTES: Final = 256 * 1024
#: How long a finished result may wait for others of its burst before the flusher sends it.
COALESCE_S: Final = 0.0002


def error_frame(code: ErrorCode, message: str) -> bytes:
    """The ERROR frame that answers a call-level failure (then the connection closes)."""
    error = pb.Error(code=code.proto_value, message=message)  # type: ignore[arg-type]
    return encode_frame(Kind.ERROR, error.SerializeToString())


def _has_bytes_waiting(sock: socket.socket) -> bool:
    """Whether the peer has sent anything yet (one non-blocking peek)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing yet (EAGAIN), or already gone
        return False


class ServedConnection:
    """One data-path connection: its reader thread's loop and the results it owes.

    Backpressure is in bytes, as on a gRPC stream: every admitted item reserves the most its
    response can take from the connection's :class:`~evald.daemon._transport.OutputBudget`
    until the frame carrying its result is in the socket buffer. At the bound the reader stops
    reading; a client that then takes nothing for ``stream_stall_s`` is cut off.
    """

    def __init__(
        self,
        core: Core,
        forget: Callable[[ServedConnection], None],
        sock: socket.socket,
        number: int,
        peer: Peer,
        leave_unauthenticated: Callable[[], None],
    ) -> None:
        self._forget = forget
        self._leave_unauthenticated = leave_unauthenticated
        self.accepted_at = time.monotonic()
        self.peer = peer
        self.authenticating = True  # no HELLO yet
        # Whether any byte has arrived: a client sends its HELLO as it connects, so it is
        # usually in the socket buffer before the connection is accepted (peeked here).
        self.heard = _has_bytes_waiting(sock)
        self._core = core
        settings = self._core.settings
        self._sock = sock
        # Blocking, and it stays so: deadlines are kept with poll (see _frame_reader), since a
        # socket timeout would apply to the writer thread's sends as well.
        sock.settimeout(None)
        self._name = f"evald-data-{number}"
        self._writer = FrameWriter(
            sock,
            f"{self._name}-writer",
            stall_s=settings.stream_stall_s,
            on_sent=self._release,
            on_failed=self._writer_failed,
        )
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # room freed, or closed
        self._flush_wake = threading.Condition(self._lock)
        self._results: list[tuple[pb.EvaluateResponse, int]] = []
        self._budget: OutputBudget | None = None  # once authenticated
        self._live: dict[int, Batch] = {}  # batches with items not yet answered, by id()
        self._flusher: threading.Thread | None = None
        self._closed = False
        self._aborted = False  # the daemon's grace ran out: stop waiting for results
        self._bound = settings.stream_unread_bytes
        self._stall_s = settings.stream_stall_s
        self._max_frame = settings.max_message_bytes
        self._token: str | None = None  # the HELLO's credential
        self._revoked: tuple[ErrorCode, str] | None = None
        self.thread = threading.Thread(target=self._serve, name=self._name, daemon=True)

    def revoke(self, error: EvaldError) -> None:
        """Ends the connection with ``error`` (its token was revoked); any thread. It stops
        reading, answers what it admitted, then sends the ERROR frame and closes."""
        self._revoked = (error.code, error.message)
        self.shut_reading()

    # -- the reader thread ---------------------------------------------------------------

    def _serve(self) -> None:
        core = self._core
        tenant_label = "unauthenticated"
        code = "ok"
        failure: tuple[ErrorCode, str] | None = None
        authenticated = False
        leave: Callable[[], None] | None = None
        unwatch: Callable[[], None] | None = None
        try:
            try:
                tenant = self._hello()
            finally:
                self.authenticating = False
                self._leave_unauthenticated()
            tenant_label = tenant.name
            # One call of its tenant's max_calls, and one of its share of the connections.
            leave = core.enter(tenant, "data")
            unwatch = core.watch_token(tenant, self._token, self.revoke)
            budget = self._budget = OutputBudget(tenant, self._bound, self.wake)
            authenticated = True
            self._writer.send(encode_frame(Kind.READY, tenant.name.encode("utf-8")))
            self._read_batches(tenant, budget)
        except Idle:
            _log.info("data connection closed: idle", extra={"fields": {"tenant": tenant_label}})
            self._close_idle()
        except (FrameError, EvaldError) as exc:
            failure = (exc.code, exc.message)
        except OSError:
            code = "cancelled"  # the peer went away (or stopped reading): nobody to answer
            authenticated = False
        except Exception:
            _log.exception("data connection failed", extra={"fields": {"tenant": tenant_label}})
            failure = (ErrorCode.INTERNAL, "internal error in the daemon (see its log)")
        finally:
            if unwatch is not None:
                unwatch()
            if self._revoked is not None:
                failure = self._revoked
            if isinstance(self._writer.failed, WriterStalled):
                _log.info(
                    "data connection cut off: its client stopped reading",
                    extra={"fields": {"tenant": tenant_label, "unread_bytes": self._unread()}},
                )
                failure = (
                    ErrorCode.QUOTA_EXCEEDED,
                    f"the client read no results for {self._stall_s:g} s while they waited "
                    f"(stream_unread_bytes is {self._bound}); the connection is ended: read "
                    "results as they come",
                )
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
            if leave is not None:
                leave()
            core.observe_call(METHOD, tenant_label, code)
            self._forget(self)

    def _read_batches(self, tenant: Tenant, budget: OutputBudget) -> None:
        """Reads and admits BATCH frames until the client is done or the daemon stops.

        A frame's bytes count in the tenant's ``request_bytes`` from its header until its items
        are admitted (the reader waits for room before reading them), and must arrive within
        ``frame_timeout_s`` of the header.

        Raises:
            Idle: nothing arrived for ``idle_timeout_s`` while nothing was in flight.
            FrameError, EvaldError: a protocol error, a frame too slow, the daemon stopping.
            OSError: the peer left.
        """
        core = self._core
        frames = FrameReader(self._sock, self._max_frame, core.settings.frame_timeout_s)
        idle_timeout_s = core.settings.idle_timeout_s

        def busy() -> bool:
            return budget.reserved > 0 or core.stopping

        while not core.stopping:
            if self._writer.failed is not None:
                raise self._writer.failed  # the peer is gone: what it sent is moot
            header = frames.next_header(idle_timeout_s, busy)
            if header is None:
                break  # the client is done sending: answer what it sent, then close
            kind, length = header
            if kind is not Kind.BATCH:
                raise FrameError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"expected a BATCH frame, got {kind.name}; HELLO comes once, first",
                )
            while True:
                seen = budget.freed
                if tenant.reserve_request(length):
                    break
                self._wait_for_room(budget, seen)
            try:
                self._submit(tenant, budget, frames.payload(length))
            finally:
                tenant.free_request(length)
        if core.stopping:
            raise shutting_down()

    def _hello(self) -> Tenant:
        """Reads the HELLO straight from the socket: at most MAX_HELLO_BYTES are ever taken
        from an unauthenticated peer (no buffered reader yet), all within one deadline (a
        client sending a byte every few seconds does not hold the connection open)."""
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        sock = self._sock

        def read(size: int) -> bytes:
            data = bytearray()
            while len(data) < size:
                chunk = recv_within(sock, size - len(data), deadline - time.monotonic())
                if not chunk:
                    break
                self.heard = True
                data += chunk
            return bytes(data)

        try:
            frame = read_frame(read, MAX_HELLO_BYTES)
        except TimeoutError:
            raise EvaldError(
                ErrorCode.PERMISSION_DENIED,
                f"no HELLO frame within {HELLO_TIMEOUT_S:g} s; a connection authenticates first",
            ) from None
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
        self._token = token or None
        return self._core.authenticate_token(self._token, over_unix=True)

    def _unread(self) -> int:
        return self._budget.reserved if self._budget is not None else 0

    def _release(self, credit: int) -> None:
        """Results of ``credit`` reserved bytes are in the socket buffer (the writer thread)."""
        if self._budget is not None:
            self._budget.release(credit)

    def wake(self) -> None:
        """The tenant freed output bytes (any thread): a reader waiting for room looks again."""
        with self._lock:
            self._changed.notify_all()

    def _writer_failed(self, _error: OSError) -> None:
        self.wake()
        self.shut_reading()  # a reader blocked on the socket sees the end

    def _submit(self, tenant: Tenant, budget: OutputBudget, payload: bytes) -> None:
        try:
            message = pb.EvaluateBatchRequest.FromString(payload)
        except DecodeError:
            raise FrameError(
                ErrorCode.INVALID_ARGUMENT,
                "a BATCH frame is not a valid evald.v1.EvaluateBatchRequest (corrupt protobuf, "
                "or a string field that is not UTF-8)",
            ) from None
        intake = Intake(self._core, tenant, budget, message.items)
        while True:
            admitted = intake.advance()
            self._dispatch(admitted.queue, admitted.refused)
            if not admitted.blocked:
                return
            # No room: what is admitted runs first, so its results free some.
            self._wait_for_room(budget, admitted.seen)

    def _wait_for_room(self, budget: OutputBudget, seen: int) -> None:
        """Waits (the reader stops reading) until room may have been freed since ``seen``.

        Raises:
            OSError: the writer failed (the peer left, or stopped reading too long).
            EvaldError: ``unavailable`` when the daemon stops meanwhile.
        """
        with self._lock:
            while budget.freed == seen:
                if self._writer.failed is not None:
                    raise self._writer.failed
                if self._core.stopping:
                    raise shutting_down()
                self._changed.wait(0.5)

    def _dispatch(
        self, queue: collections.deque[Work], refused: list[tuple[pb.EvaluateResponse, int]]
    ) -> None:
        """Answers the refused items and schedules the admitted ones."""
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

        def deliver(work: Work, response: pb.EvaluateResponse) -> None:
            with self._lock:
                if self._closed:
                    return
                results = self._results
                results.append((response, work.reserved))
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

        batch = Batch(None, queue, deliver)
        with self._lock:
            self._live[id(queue)] = batch
        added, scheduled = self._core.enqueue(batch)
        if not scheduled:
            self._core.abandon(batch, added)

    # -- results ------------------------------------------------------------------------

    def _take_locked(self) -> list[tuple[pb.EvaluateResponse, int]]:
        results, self._results = self._results, []
        return results

    def _send(self, results: list[tuple[pb.EvaluateResponse, int]]) -> None:
        """Sends results (any thread) as RESULTS frames within ``max_message_bytes`` each (a
        value past a whole frame becomes its own ``output_too_large``); their reserved bytes
        return to the budgets once each frame is in the socket buffer."""
        for batch, credit in pack_responses(results, self._max_frame):
            frame = encode_frame(
                Kind.RESULTS, pb.EvaluateBatchResponse(results=batch).SerializeToString()
            )
            try:
                self._writer.send(frame, credit)
            except ConnectionError:  # the reader sees the peer gone
                self._release(credit)

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
        if authenticated:  # every admitted item ends within its deadline
            with self._lock:
                while self._unread() > 0 and self._writer.failed is None and not self._aborted:
                    self._changed.wait(0.5)
        with self._lock:
            self._closed = True
            live = list(self._live.values())
            self._live.clear()
            self._flush_wake.notify_all()
            self._changed.notify_all()
        if self._budget is not None:
            self._budget.close()  # results that will never be sent
        for batch in live:
            self._core.abandon(batch, True)
        if failure is not None:
            with contextlib.suppress(ConnectionError):
                self._writer.send(error_frame(*failure))
            if self._writer.failed is not None:  # best effort: maybe the buffer has room
                with contextlib.suppress(OSError):
                    self._sock.send(error_frame(*failure), socket.MSG_DONTWAIT)
        self._writer.close(timeout_s=1.0)
        self.close_socket()

    def _close_idle(self) -> None:
        """Ends an idle connection cleanly: end-of-stream first, then what the client sent in
        the meantime is read and dropped until it closes its end (at most a second). A frame
        that crossed the end-of-stream is never answered, and the client, seeing a clean end,
        sends it again on a new connection; closing with it unread would reset the connection
        instead, which the client must treat as a failure."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
            give_up = time.monotonic() + 1.0
            with contextlib.suppress(TimeoutError):
                while recv_within(self._sock, _CHUNK_BYTES, give_up - time.monotonic()):
                    pass

    def evict(self) -> None:
        """Ends a connection that sent no HELLO, now (the accept thread, making room)."""
        self.authenticating = False
        self._leave_unauthenticated()
        self.shut_reading()

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
            self._sock.close()
