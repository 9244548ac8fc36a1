"""What one caller can take from the others: the services that need no token, the pools the
tenants share, and bytes that arrive slowly.

* :func:`open_service_flood`: more health ``Watch`` streams than the daemon gives callers
  without a token, and health requests far over the size it reads from them: the extra streams
  get a typed ``unavailable``, the large requests ``invalid_argument``, and meanwhile the
  victim's calls and the monitor's health checks are served;
* :func:`data_connection_hog`: the attacker opens data-path connections past its share (typed
  ``quota_exceeded``) and silent connections that never send a HELLO, and the victim still
  connects and is served;
* :func:`hello_churn`: a token-less peer (a process of its own) churns data-path connections
  that each send one HELLO byte and close after 0.2 s, about 400 a second; the victim's
  connections beside it are all served (they were refused 33 times of 40 once);
* :func:`stalled_frames`: requests that never arrive whole, a data-path frame one byte short
  and a unary gRPC call that sends no message: each ended with a typed ``quota_exceeded`` within
  ``frame_timeout_s``, their bytes held by the attacker's budget meanwhile (the run's RSS bound).
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from evald.client import CallError, DataCallError, DataConnection
from evald.contract import HEADER, HELLO_MAGIC, ErrorCode, Kind, encode_frame, pb
from evald.testing import HelloChurn
from evald_lab.fuzz.checks import Violation
from evald_lab.fuzz.context import FuzzContext
from evald_lab.fuzz.protocol.raw_calls import KLASS, SERVICE, raw_channel, record_refusal

__all__ = ["data_connection_hog", "hello_churn", "open_service_flood", "stalled_frames"]

#: What the fuzz daemon is configured with (:func:`evald_lab.fuzz.settings.fuzz_config`).
OPEN_CALLS = 16
DATA_MAX_CONNECTIONS = 32
DATA_UNAUTHENTICATED = 8
FRAME_TIMEOUT_S = 2.0


def _victim_evaluates(ctx: FuzzContext, family: str) -> None:
    """The victim's unary call, beside whatever the scenario holds: it must be served."""
    try:
        response = ctx.client(ctx.victim).evaluate("calc", b"17 * 23 + 91")
    except CallError as error:
        ctx.recorder.add(
            [Violation("unexpected", KLASS, f"{family}: the victim was refused: {error}")]
        )
        return
    # Served is what counts here: under load its evaluation may end in its own deadline.
    if response.value != "482" and response.error.code != ErrorCode.DEADLINE_EXCEEDED.proto_value:
        ctx.recorder.add([Violation("unexpected", KLASS, f"{family}: the victim got {response}")])


def open_service_flood(ctx: FuzzContext, rng: random.Random) -> None:
    """Health Watch streams past the open budget, and oversized health requests."""
    family = "open_service_flood"
    channel = raw_channel(ctx)
    watches = []
    served = 0
    try:
        health = health_pb2_grpc.HealthStub(channel)
        name = "n" * rng.choice((64 << 10, 1 << 20, 4 << 20))
        for call in (health.Check, health.Watch):
            try:
                result = call(health_pb2.HealthCheckRequest(service=name), timeout=30)
                if call is health.Watch:
                    next(result)
                ctx.recorder.add([Violation("unexpected", KLASS, "a huge health request served")])
            except grpc.RpcError as error:
                # unavailable: another lane's streams hold the open budget (typed, fine).
                record_refusal(ctx, family, error, ("invalid_argument", "unavailable"))
        for _ in range(OPEN_CALLS + rng.choice((4, 16))):
            watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=60)
            watches.append(watch)
            try:
                next(watch)
                served += 1
                ctx.recorder.outcome(KLASS, "served", family=family)
            except grpc.RpcError as error:
                record_refusal(ctx, family, error, ("unavailable",))
        if served > OPEN_CALLS:
            ctx.recorder.add(
                [Violation("unexpected", KLASS, f"{served} Watch streams past open_calls")]
            )
        try:  # the probes' room: a Check still gets through the flood of streams
            health.Check(health_pb2.HealthCheckRequest(), timeout=30)
        except grpc.RpcError as error:
            ctx.recorder.add([Violation("hang", KLASS, f"health Check during a flood: {error}")])
        _victim_evaluates(ctx, family)
    finally:
        for watch in watches:
            watch.cancel()
        channel.close()


def _connect(ctx: FuzzContext, tenant: str) -> DataConnection | DataCallError:
    assert ctx.data_target is not None
    try:
        return DataConnection.connect(ctx.data_target, ctx.tokens[tenant])
    except DataCallError as exc:
        return exc


def _victim_connects(ctx: FuzzContext, family: str) -> None:
    connection = _connect(ctx, ctx.victim)
    if isinstance(connection, DataCallError):
        ctx.recorder.add(
            [Violation("unexpected", KLASS, f"{family}: the victim was refused: {connection}")]
        )
        return
    with connection:
        connection.send(
            pb.EvaluateBatchRequest(
                items=[pb.EvaluateRequest(evaluator="calc", input=b"6 * 7", id="v")]
            )
        )
        message = connection.receive()
    if message is None or len(message.results) != 1:
        ctx.recorder.add([Violation("unexpected", KLASS, f"{family}: the victim not served")])
        return
    result = message.results[0]
    if result.value != "42" and result.error.code != ErrorCode.DEADLINE_EXCEEDED.proto_value:
        ctx.recorder.add([Violation("unexpected", KLASS, f"{family}: the victim got {result}")])


def data_connection_hog(ctx: FuzzContext, rng: random.Random) -> None:
    """The attacker's data-path connections past its share, then silent connections."""
    target = ctx.data_target
    if target is None:
        return
    family = "data_connection_hog"
    held: list[DataConnection] = []
    silent: list[socket.socket] = []
    try:
        for _ in range(DATA_MAX_CONNECTIONS // 2 + 4):
            connection = _connect(ctx, ctx.attacker)
            if isinstance(connection, DataCallError):
                ctx.recorder.outcome(KLASS, f"call:{connection.code.value}", family=family)
                ctx.recorder.add(
                    ctx.checker.call_error(
                        KLASS,
                        connection.code.value,
                        connection.message,
                        expected=("quota_exceeded",),
                    )
                )
                break
            held.append(connection)
        if len(held) > DATA_MAX_CONNECTIONS // 2:
            ctx.recorder.add(
                [Violation("unexpected", KLASS, f"the attacker held {len(held)} connections")]
            )
        _victim_connects(ctx, family)
        for _ in range(DATA_UNAUTHENTICATED * rng.choice((1, 3))):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with contextlib.suppress(OSError):
                sock.connect(target[len("unix:") :])
            silent.append(sock)
        time.sleep(0.4)  # past the grace a connection has to send its HELLO
        _victim_connects(ctx, family)
        ctx.recorder.outcome(KLASS, "ok", family=family)
    finally:
        for connection in held:
            connection.close()
        for sock in silent:
            sock.close()


def hello_churn(ctx: FuzzContext, rng: random.Random) -> None:
    """A peer churning half-sent HELLOs beside the victim's connections: none is refused."""
    target = ctx.data_target
    if target is None:
        return
    family = "hello_churn"
    with HelloChurn(target[len("unix:") :]) as churn:
        time.sleep(0.3)  # under way
        for _ in range(rng.choice((5, 10))):
            _victim_connects(ctx, family)
    if churn.opened < 20:
        ctx.recorder.add(
            [Violation("unexpected", KLASS, f"{family}: the churn opened {churn.opened} only")]
        )
    ctx.recorder.outcome(KLASS, "ok", family=family)


def _stalled_frame(ctx: FuzzContext, length: int) -> None:
    """One data-path connection that sends a BATCH header and one byte less than it says."""
    family = "stalled_frames"
    target = ctx.data_target
    assert target is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(FRAME_TIMEOUT_S * 4 + 30)
        try:
            sock.connect(target[len("unix:") :])
            sock.sendall(encode_frame(Kind.HELLO, HELLO_MAGIC + ctx.tokens[ctx.attacker].encode()))
            reader = sock.makefile("rb")
            header = reader.read(HEADER.size)
            size, kind = HEADER.unpack(header)
            reader.read(size)
            if kind != Kind.READY:  # its share of connections may be taken: typed, fine
                ctx.recorder.outcome(KLASS, "refused", family=family)
                return
            started = time.monotonic()
            with contextlib.suppress(OSError):
                sock.sendall(HEADER.pack(length, Kind.BATCH) + b"\0" * (length - 1))
            header = reader.read(HEADER.size)
            waited = time.monotonic() - started
            if len(header) < HEADER.size:
                ctx.recorder.add(
                    [Violation("untyped_error", KLASS, "a stalled frame: closed without ERROR")]
                )
                return
            size, kind = HEADER.unpack(header)
            error = pb.Error.FromString(reader.read(size))
        except OSError as exc:
            ctx.recorder.add([Violation("unexpected", KLASS, f"a stalled frame: {exc!r}")])
            return
    code = ErrorCode.from_proto(error.code).value
    ctx.recorder.outcome(KLASS, f"call:{code}", family=family)
    expected = ("quota_exceeded",)
    ctx.recorder.add(ctx.checker.call_error(KLASS, code, error.message, expected=expected))
    if waited > FRAME_TIMEOUT_S * 4 + 10:  # it may wait for the tenant's request_bytes first
        ctx.recorder.add([Violation("hang", KLASS, f"a stalled frame was held {waited:.1f} s")])


def stalled_frames(ctx: FuzzContext, rng: random.Random) -> None:
    """Requests that never arrive whole, on both transports."""
    family = "stalled_frames"
    never = threading.Event()

    def no_message() -> Iterator[bytes]:
        never.wait(60)
        yield b""

    threads: list[threading.Thread] = []
    if ctx.data_target is not None:
        length = rng.choice((64 << 10, 1 << 20, ctx.max_message_bytes))
        threads = [
            threading.Thread(target=_stalled_frame, args=(ctx, length), name=f"fuzz-stall-{i}")
            for i in range(rng.choice((1, 4)))
        ]
    for thread in threads:
        thread.start()
    with raw_channel(ctx) as channel:
        call = channel.stream_unary(f"{SERVICE}/Evaluate")
        try:
            call(no_message(), timeout=FRAME_TIMEOUT_S + 30, metadata=ctx.metadata(ctx.attacker))
            ctx.recorder.add([Violation("unexpected", KLASS, "a call without a message served")])
        except grpc.RpcError as error:
            record_refusal(ctx, family, error, ("quota_exceeded",))
    never.set()
    _victim_evaluates(ctx, family)
    for thread in threads:
        thread.join()
