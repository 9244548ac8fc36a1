"""The engine data path: ``EvaluateStream``'s messages as length-prefixed frames on a unix socket.

Why a second transport: on the engine's path a gRPC message costs far more than the evaluation
it carries (HTTP/2 framing, the asyncio loop, thread hand-offs: hundreds of microseconds for a
few microseconds of guest time), while a length-prefixed protobuf over a unix socket costs tens.
So ``[server] data_listen`` opens a unix socket that carries exactly the messages of
``EvaluateStream`` in the frames of :mod:`evald.contract._frames`; gRPC stays the control plane
(listing, registration, health) and the only TCP/TLS transport.

It is the same daemon behind another door, not a second implementation: this module sees the
daemon as the :class:`~evald.daemon._transport.Core` the gRPC service sees, and admits a
message's items with the same :class:`~evald.daemon._transport.Intake`. A connection is
authenticated by :meth:`Core.authenticate_token` (its first frame, a HELLO of at most
:data:`~evald.contract.MAX_HELLO_BYTES`, carries the bearer token, handed over as is: no
header is built to be parsed back; it is read straight from
the socket, so nothing past it is buffered before it passes, and it must come within
:data:`HELLO_TIMEOUT_S`); each item goes through
:meth:`Core.prepare` (evaluator resolution, quotas, rate) and the daemon's fair scheduler
(:meth:`Core.enqueue`: the same per-tenant queues, ``max_running`` caps and round-robin
as gRPC calls, on the same worker threads); evaluation errors are the same ``EvaluateResponse``
values, call-level errors the same codes (an ERROR frame, then the connection closes).

Threads: one accepts (here, :class:`DataServer`); each connection has a reader thread and,
when needed, a flusher and a writer (:mod:`evald.daemon._data_connection`, which says who
sends what). Results go out in frames of at most ``max_message_bytes`` of values
(:func:`~evald.daemon._gatekeeping.pack_responses`, as on the gRPC stream). Backpressure is in
bytes (:class:`~evald.daemon._transport.OutputBudget`): past ``stream_unread_bytes`` for the
connection or the tenant's ``unread_bytes`` (shared with its gRPC streams) the reader stops
reading, so a client that sends without reading stalls itself (the socket buffer fills) and
nobody else, and one that reads nothing for ``stream_stall_s`` is cut off.

What a connection may take from others: before its HELLO it counts in the small pool of
connections with no tenant yet (``data_unauthenticated_connections``), where each slot is paid
for by the peer process that holds it (:func:`peer_of`, from ``SO_PEERCRED``): when the pool is
full, a new connection makes room at the expense of the peer holding the most slots, which is
its own peer when that peer already holds as many as anyone (:func:`choose_eviction`), so a
peer churning connections evicts only its own (:mod:`evald.daemon._data_peers`); then it is
one call of its tenant's ``max_calls`` and one of its share of ``data_max_connections``
(:meth:`Core.enter`). Its frames are read by
:class:`~evald.daemon._frame_reader.FrameReader`: each must arrive within ``frame_timeout_s`` of
its header, and counts in its tenant's ``request_bytes`` from the header until its items are
admitted (the reader waits for room before reading the payload). A connection with nothing in
flight that sends nothing for ``idle_timeout_s`` is ended cleanly.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from evald.contract import ErrorCode, EvaldError
from evald.contract import unix_socket_path as socket_file
from evald.daemon._data_connection import (
    COALESCE_S,
    HELLO_TIMEOUT_S,
    METHOD,
    ServedConnection,
    error_frame,
)
from evald.daemon._data_peers import HELLO_GRACE_S, Peer, choose_eviction, peer_of
from evald.daemon._lifecycle import check_unix_socket
from evald.daemon._transport import Core

__all__ = [
    "COALESCE_S",
    "HELLO_GRACE_S",
    "HELLO_TIMEOUT_S",
    "METHOD",
    "DataServer",
    "Peer",
    "choose_eviction",
    "peer_of",
    "unix_socket_path",
]


def unix_socket_path(target: str) -> Path:
    """The file of a ``unix:PATH`` or ``unix:///PATH`` address, made absolute.

    Raises:
        EvaldError: ``invalid_argument`` when ``target`` is not a unix address.
    """
    path = socket_file(target)
    if path is None:
        raise EvaldError(ErrorCode.INVALID_ARGUMENT, f"expected unix:PATH, got {target!r}")
    return path


class DataServer:
    """The data path's listener and connections, for one daemon."""

    def __init__(self, core: Core, target: str) -> None:
        self.core = core
        self.path = unix_socket_path(target)
        self._listener: socket.socket | None = None
        self._connections: set[ServedConnection] = set()
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
        check_unix_socket(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mode = self.core.settings.socket_mode
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
            peer = peer_of(sock)
            try:
                leave = self._enter_unauthenticated(peer)
            except EvaldError as exc:
                with contextlib.suppress(OSError):
                    sock.send(error_frame(exc.code, exc.message), socket.MSG_DONTWAIT)
                sock.close()
                self.core.observe_call(METHOD, "unauthenticated", exc.code.value)
                continue
            with self._lock:
                if self._stopping:
                    leave()
                    sock.close()
                    return
                self._count += 1
                connection = ServedConnection(
                    self.core, self.forget, sock, self._count, peer, leave
                )
                self._connections.add(connection)
            connection.thread.start()

    def _enter_unauthenticated(self, peer: Peer) -> Callable[[], None]:
        """Counts a new connection from ``peer`` in the small pool of peers with no tenant yet
        (until its HELLO passes; then it counts in its tenant's share of
        ``data_max_connections``).

        When that pool is full, a connection of the peer holding the most slots makes room
        (:func:`choose_eviction`): a peer that churns connections, however fast, evicts its own,
        and a client with one connection among a flood is never the one evicted.

        Raises:
            EvaldError: ``unavailable`` when the pool is full of other peers' connections
                holding no more than their share, whose HELLOs are arriving within the grace.
        """
        try:
            return self.core.enter_unauthenticated("data")
        except EvaldError:
            with self._lock:
                waiting = [c for c in self._connections if c.authenticating]
            chosen = choose_eviction(waiting, peer, time.monotonic(), HELLO_GRACE_S)
            if chosen is None:
                raise
            chosen.evict()
            return self.core.enter_unauthenticated("data")

    def forget(self, connection: ServedConnection) -> None:
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
