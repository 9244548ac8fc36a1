"""The engine-wide evald client: one bidirectional ``EvaluateStream`` per engine worker.

Engines submit spans from their decode loop (:meth:`EvaluatorClient.submit` never blocks) and call
:meth:`~EvaluatorClient.flush` once per step, so every span that closed in one step travels in one
message (a stream round trip costs ~0.5 ms; a unary RPC ~1 ms each, docs/design.md §6).
Results come back as they complete and resolve the futures by id.

With a ``data_target`` (or ``$EVALD_DATA_TARGET``), the same messages travel over the daemon's
data path instead (``[server] data_listen``, docs/data-path.md): length-prefixed frames on a
unix socket, a round trip of tens of microseconds rather than hundreds. Everything below holds
for both; gRPC stays the control plane (``ListEvaluators``: :mod:`._listing`).

Failure rules, so that a request never stalls on evald:

- every future completes no later than its ``deadline_ms`` (``deadline_exceeded``), whatever the
  daemon does — even when it hangs (stopped, overloaded);
- when the daemon cannot be reached or the stream breaks, pending and new spans get
  ``unavailable`` at once, and a background thread reconnects with exponential backoff
  (a submission while disconnected also triggers an early retry);
- call-level refusals (a bad token) become the daemon's error code for the spans concerned;
- a connection the daemon ends cleanly (it closes idle ones, ``idle_timeout_s``) is reopened at
  once: spans submitted meanwhile, or sent as it closed, go out on the new one rather than fail.

Threads: one reads the stream (and reconnects), one enforces deadlines. gRPC's own threads
consume the outgoing queue. The client is thread-safe: many injectors may share it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import heapq
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

from engine_adapter.spans import EvalResult
from evald.client import DataCallError, DataConnection, resolve_endpoint
from evald.contract import (
    CLIENT_MAX_MESSAGE_BYTES,
    ErrorCode,
    decode_rpc_error,
    pb,
    pb_grpc,
    unix_socket_path,
)

__all__ = ["ClientStats", "EvaluatorClient"]

_UNAVAILABLE: str = ErrorCode.UNAVAILABLE
_DEADLINE: str = ErrorCode.DEADLINE_EXCEEDED


@dataclass
class ClientStats:
    """Counters for benchmarks and logs (read without locking: approximate while running)."""

    submitted: int = 0
    completed: int = 0
    unavailable: int = 0
    deadline_exceeded: int = 0
    messages_sent: int = 0
    connects: int = 0
    disconnects: int = 0


@dataclass
class _Pending:
    future: concurrent.futures.Future[EvalResult]
    deadline_at: float
    request: Any  # the EvaluateRequest, to send again on a new connection after a clean end


class _Connection:
    """One stream: its outgoing queue and the call object (for cancellation)."""

    _END = object()

    def __init__(self) -> None:
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.call: Any = None

    def send(self, message: Any) -> None:
        self.outbox.put(message)

    def requests(self) -> Iterator[Any]:
        while True:
            item = self.outbox.get()
            if item is self._END:
                return
            yield item

    def close(self) -> None:
        self.outbox.put(self._END)
        if self.call is not None:
            self.call.cancel()


class _DataLink:
    """A data-path connection in the shape the client's loop uses (send, close)."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def send(self, message: Any) -> None:
        with contextlib.suppress(ConnectionError):  # the reader sees the break and says so
            self.connection.send(message)

    def close(self) -> None:
        self.connection.close()


class _Down(NamedTuple):
    """Why there is no connection: it could not be opened, or it ended. The spans waiting on it
    fail with ``code`` and ``message``; named fields, so the two are never swapped."""

    message: str
    code: str = _UNAVAILABLE
    #: The daemon ended the connection cleanly (it closes idle ones): reconnect at once, and
    #: let spans submitted meanwhile wait for the new connection instead of failing.
    clean: bool = False


#: An open connection and the call that reads its results until it ends, or why there is none.
_Opened = _Down | tuple[_Connection | _DataLink, Callable[[], _Down]]


class EvaluatorClient:
    """A :class:`~engine_adapter.SpanEvaluator` backed by the evald daemon.

    Parameters:
        target: ``unix:PATH`` or ``HOST:PORT``; default ``evald.default_target()``.
        token: bearer token sent as ``authorization: Bearer TOKEN``; default ``$EVALD_TOKEN``.
        connect_timeout_s: how long one connection attempt may take.
        backoff_initial_s, backoff_max_s: reconnect delays (doubling after each failure).
        tls_ca, tls_cert, tls_key: PEM files for TLS / mutual TLS over TCP.
        data_target: ``unix:PATH`` of the daemon's data path (``[server] data_listen``); default
            ``$EVALD_DATA_TARGET``; None: the gRPC stream to ``target``.
        env_token: read ``$EVALD_TOKEN`` when ``token`` is None (False: None means none).

    Raises:
        evald.CallError: ``permission_denied`` for a named token that is empty, blank or
            malformed (nothing is dialled).

    Connecting starts at once in the background; spans submitted before the first connection
    is up wait for it (until their deadline), spans submitted after a failure fail fast.
    """

    def __init__(
        self,
        target: str | None = None,
        token: str | None = None,
        *,
        connect_timeout_s: float = 2.0,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        max_message_bytes: int = CLIENT_MAX_MESSAGE_BYTES,
        data_target: str | None = None,
        env_token: bool = True,
    ) -> None:
        endpoint = resolve_endpoint(
            target, token, env_token=env_token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        self._endpoint = endpoint
        self.target = endpoint.target
        self.data_target = data_target or os.environ.get("EVALD_DATA_TARGET") or None
        self._token = endpoint.token
        self._metadata = endpoint.metadata
        self._connect_timeout_s = connect_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._max_message_bytes = max_message_bytes
        self._options = (
            ("grpc.enable_retries", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        )
        self._credentials = endpoint.credentials()
        self.stats = ClientStats()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[str, _Pending] = {}
        self._unsent: list[Any] = []
        self._deadlines: list[tuple[float, str]] = []
        self._deadline_wake = threading.Condition(self._lock)
        self._state = "connecting"  # connecting → up ⇄ down; closed
        self._down_code = _UNAVAILABLE
        self._down_message = f"evald at {self.target} is not reachable"
        self._connection: _Connection | _DataLink | None = None
        self._channel: grpc.Channel | None = None
        self._kick = threading.Event()
        self._closed = threading.Event()
        self._io = threading.Thread(target=self._run_io, name="evald-stream", daemon=True)
        self._reaper = threading.Thread(
            target=self._run_reaper, name="evald-deadlines", daemon=True
        )
        self._io.start()
        self._reaper.start()

    # ------------------------------------------------------------------ SpanEvaluator

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        """Queues one evaluation; returns at once. The future never raises."""
        future: concurrent.futures.Future[EvalResult] = concurrent.futures.Future()
        request_id = str(next(self._ids))
        deadline_ms = max(1, int(deadline_ms))
        now = time.monotonic()
        with self._lock:
            self.stats.submitted += 1
            state = self._state
            if state in ("connecting", "up"):
                request = pb.EvaluateRequest(
                    evaluator=evaluator,
                    input=content.encode("utf-8", errors="surrogateescape"),
                    deadline_ms=deadline_ms,
                    id=request_id,
                )
                self._pending[request_id] = _Pending(future, now + deadline_ms / 1000.0, request)
                self._unsent.append(request)
                heapq.heappush(self._deadlines, (now + deadline_ms / 1000.0, request_id))
                self._deadline_wake.notify()
        if state == "down":
            self._kick.set()
            self._fail(future, self._down_code, self._down_message)
        elif state == "closed":
            self._fail(future, _UNAVAILABLE, "the evaluator client is closed")
        return future

    def flush(self) -> None:
        """Sends every span submitted since the last flush as one stream message."""
        with self._lock:
            if self._state != "up" or not self._unsent or self._connection is None:
                return
            items = [r for r in self._unsent if r.id in self._pending]
            self._unsent = []
            connection = self._connection
            if items:
                self.stats.messages_sent += 1
        if items:
            connection.send(pb.EvaluateBatchRequest(items=items))

    # ------------------------------------------------------------------ lifecycle

    @property
    def connected(self) -> bool:
        return self._state == "up"

    def wait_connected(self, timeout_s: float) -> bool:
        """Blocks until the stream is up (for start-up checks and tests)."""
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            if self._state == "up":
                return True
            if self._state == "down":
                self._kick.set()
            time.sleep(0.01)
        return self._state == "up"

    def close(self) -> None:
        """Stops the threads; pending spans get ``unavailable``. Idempotent."""
        with self._lock:
            if self._state == "closed":
                return
            self._state = "closed"
            connection, self._connection = self._connection, None
            self._deadline_wake.notify_all()
        self._closed.set()
        self._kick.set()
        if connection is not None:
            connection.close()
        self._fail_all("the evaluator client was closed")
        self._io.join(timeout=5)
        self._reaper.join(timeout=5)
        if self._channel is not None:
            self._channel.close()

    def __enter__(self) -> EvaluatorClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------------ threads

    def _new_channel(self) -> grpc.Channel:
        if self._channel is not None:
            self._channel.close()
        channel = self._endpoint.channel(
            max_message_bytes=self._max_message_bytes,
            options=self._options,
            credentials=self._credentials,
        )
        self._channel = channel
        return channel

    def _run_io(self) -> None:
        """Connects, reads results until the connection ends, and starts over with backoff.

        The same states, backoff and failure rules for both transports: only opening a
        connection and reading from it differ (:meth:`_open_stream`, :meth:`_open_data_link`).
        """
        open_link = self._open_data_link if self.data_target is not None else self._open_stream
        backoff = self._backoff_initial_s
        while not self._closed.is_set():
            opened = open_link()
            if isinstance(opened, _Down):
                self._go_down(opened.message, opened.code)
                self._sleep(backoff)
                backoff = min(backoff * 2, self._backoff_max_s)
                continue
            link, read = opened
            with self._lock:
                if self._state == "closed":
                    link.close()
                    return
                self._state = "up"
                self._connection = link
                self.stats.connects += 1
            self.flush()  # whatever was submitted while connecting
            ended = read()
            with self._lock:
                if self._connection is link:
                    self._connection = None
            link.close()
            if self._closed.is_set():
                return
            self.stats.disconnects += 1
            if ended.clean:
                self._reconnect_soon()
                backoff = self._backoff_initial_s
                continue
            self._go_down(ended.message, ended.code)
            if ended.code == _UNAVAILABLE:
                backoff = self._backoff_initial_s  # it was up: retry soon
            self._sleep(backoff)
            backoff = min(backoff * 2, self._backoff_max_s)

    def _open_stream(self) -> _Opened:
        """A gRPC channel and an ``EvaluateStream`` call, or why there is none."""
        socket_path = unix_socket_path(self.target)
        if socket_path is not None and not os.path.exists(socket_path):
            # No daemon has ever listened here (or it was removed): fail spans now rather than
            # after a connect timeout that may exceed their deadlines.
            return _Down(f"evald is not running: no socket at {socket_path}")
        channel = self._new_channel()
        try:
            grpc.channel_ready_future(channel).result(timeout=self._connect_timeout_s)
        except (grpc.FutureTimeoutError, grpc.RpcError, ValueError):
            return _Down(f"cannot connect to evald at {self.target}")
        connection = _Connection()
        stub = pb_grpc.EvaluatorStub(channel)  # type: ignore[no-untyped-call]
        try:
            connection.call = stub.EvaluateStream(connection.requests(), metadata=self._metadata)
        except grpc.RpcError:
            return _Down(f"cannot open a stream to evald at {self.target}")
        return connection, lambda: self._read(connection)

    def _open_data_link(self) -> _Opened:
        """A data-path connection that passed its HELLO, or why there is none."""
        target = self.data_target
        assert target is not None
        socket_path = unix_socket_path(target)
        if socket_path is None:
            return _Down(f"the data path is a unix socket (unix:PATH): {target}")
        if not os.path.exists(socket_path):
            return _Down(f"evald's data path is not running: no socket at {target}")
        try:
            link = _DataLink(
                DataConnection.connect(target, self._token, timeout_s=self._connect_timeout_s)
            )
        except DataCallError as exc:
            return _Down(exc.message, exc.code.value)
        except OSError as exc:
            return _Down(f"cannot connect to evald at {target}: {exc}")
        return link, lambda: self._read_data(link, target)

    def _read_data(self, link: _DataLink, target: str) -> _Down:
        """Reads data-path results until the connection ends; why it ended."""
        try:
            while True:
                message = link.connection.receive()
                if message is None:
                    return _Down(f"evald at {target} closed the connection", clean=True)
                for response in message.results:
                    self._complete(response.id, _result_from_proto(response))
        except DataCallError as exc:  # the daemon's ERROR frame
            return _Down(exc.message, exc.code.value)
        except (OSError, ValueError) as exc:
            return _Down(f"the connection to evald at {target} broke: {exc}")

    def _read(self, connection: _Connection) -> _Down:
        """Reads results until the stream ends; why it ended."""
        try:
            for message in connection.call:
                for response in message.results:
                    self._complete(response.id, _result_from_proto(response))
        except grpc.RpcError as error:
            failure = decode_rpc_error(error)
            if failure.code is not None:
                return _Down(failure.details, failure.code.value)
            if failure.status in (
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED,
            ):
                return _Down(failure.details, ErrorCode.PERMISSION_DENIED.value)
            return _Down(f"the stream to evald at {self.target} broke: {failure.details}")
        return _Down(f"evald at {self.target} closed the stream", clean=True)

    def _run_reaper(self) -> None:
        while True:
            expired: list[str] = []
            with self._lock:
                if self._state == "closed":
                    return
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    expired.append(heapq.heappop(self._deadlines)[1])
                if not expired:
                    timeout = self._deadlines[0][0] - now if self._deadlines else None
                    self._deadline_wake.wait(timeout)
                    continue
            for request_id in expired:
                self._complete(
                    request_id,
                    EvalResult(None, _DEADLINE, "no answer from evald within the deadline"),
                )

    # ------------------------------------------------------------------ helpers

    def _sleep(self, seconds: float) -> None:
        self._kick.wait(seconds)
        self._kick.clear()

    def _go_down(self, message: str, code: str = _UNAVAILABLE) -> None:
        with self._lock:
            if self._state != "closed":
                self._state = "down"
                self._down_code, self._down_message = code, message
        self._fail_all(message, code)

    def _reconnect_soon(self) -> None:
        """After a clean end: every span still waiting goes out again on the next connection.

        The daemon ends a connection cleanly only with nothing in flight (an idle close), so
        whatever it had not answered it never read; and an evaluation is a pure function, so
        even one read by a daemon that then died is safe to send again. Deadlines still hold.
        """
        with self._lock:
            if self._state == "closed":
                return
            self._state = "connecting"
            self._unsent = [item.request for item in self._pending.values()]

    def _fail_all(self, message: str, code: str = _UNAVAILABLE) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._unsent = []
            self._deadlines = []
        for item in pending.values():
            self._fail(item.future, code, message)

    def _fail(self, future: concurrent.futures.Future[EvalResult], code: str, message: str) -> None:
        self._settle(future, EvalResult(None, code, message))

    def _complete(self, request_id: str, result: EvalResult) -> None:
        with self._lock:
            item = self._pending.pop(request_id, None)
        if item is not None:
            self._settle(item.future, result)

    def _settle(self, future: concurrent.futures.Future[EvalResult], result: EvalResult) -> None:
        if result.error_code == _UNAVAILABLE:
            self.stats.unavailable += 1
        elif result.error_code == _DEADLINE:
            self.stats.deadline_exceeded += 1
        self.stats.completed += 1
        try:
            future.set_result(result)
        except concurrent.futures.InvalidStateError:
            pass  # cancelled by its owner


def _result_from_proto(response: Any) -> EvalResult:
    outcome = response.WhichOneof("outcome")
    if outcome == "value":
        return EvalResult(
            str(response.value), None, "", int(response.fuel_used), int(response.eval_time_us)
        )
    if outcome == "error":
        return EvalResult(
            None,
            ErrorCode.from_proto(int(response.error.code)).value,
            str(response.error.message),
            int(response.fuel_used),
            int(response.eval_time_us),
        )
    return EvalResult(None, ErrorCode.INTERNAL, "evald answered with neither a value nor an error")
