"""Protocol abuse on the engine data path (``[server] data_listen``): the same attack classes as
the gRPC scenarios of :mod:`evald_lab.fuzz.protocol`, in frames on the data socket.

* unauthenticated floods: frames before the HELLO, oversized HELLOs, wrong tokens followed by
  batches, from several threads: each connection ends with a typed ERROR, none is served, and
  the daemon's memory stays within the run's RSS bound;
* connections that send amplifying ``strop`` work and never read: bounded in bytes (the RSS
  bound), the victim served beside them;
* oversized responses: values that add up past ``max_message_bytes`` come back split into
  frames within the send limit, every item answered, each typed;
* malformed frames after the HELLO: ``invalid_argument``, and the daemon serves on.

Each scenario does nothing when the daemon has no data path (a ``--target`` without one).
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Callable

from evald.client import DataCallError, DataConnection
from evald.contract import HEADER, HELLO_MAGIC, MAX_HELLO_BYTES, ErrorCode, Kind, encode_frame, pb
from evald.daemon import send_limit
from evald_lab.fuzz.checks import Violation, outcome_label
from evald_lab.fuzz.context import FuzzContext
from evald_lab.fuzz.protocol.holding import AMPLIFY
from evald_lab.fuzz.protocol.raw_calls import KLASS

__all__ = ["DATA_HOLD_SCENARIOS", "DATA_SCENARIOS"]


def _raw(target: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(target[len("unix:") :])
    return sock


def _read_frame(read: Callable[[int], bytes], limit: int) -> tuple[int, bytes] | None:
    header = read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    length, kind = HEADER.unpack(header)
    if length > limit:
        return kind, b""
    return kind, read(length)


def _expect_error(
    ctx: FuzzContext, family: str, sock: socket.socket, expected: tuple[str, ...]
) -> None:
    """The connection must end with one ERROR frame of an expected code (and nothing served)."""
    reader = sock.makefile("rb")
    try:
        frame = _read_frame(reader.read, MAX_HELLO_BYTES * 64)
    except OSError as exc:
        frame = None
        ctx.recorder.add([Violation("untyped_error", KLASS, f"{family}: {exc!r}")])
    finally:
        reader.close()
    if frame is None:
        ctx.recorder.outcome(KLASS, "closed", family=family)
        ctx.recorder.add(
            [Violation("untyped_error", KLASS, f"{family}: closed without an ERROR frame")]
        )
        return
    kind, payload = frame
    if kind != Kind.ERROR:
        ctx.recorder.outcome(KLASS, "served", family=family)
        ctx.recorder.add(
            [Violation("tenant_leak", KLASS, f"{family}: got a {Kind(kind).name} frame")]
        )
        return
    error = pb.Error.FromString(payload)
    code = ErrorCode.from_proto(error.code).value
    ctx.recorder.outcome(KLASS, f"call:{code}", family=family)
    ctx.recorder.add(ctx.checker.call_error(KLASS, code, error.message, expected=expected))


def data_unauthenticated_flood(ctx: FuzzContext, rng: random.Random) -> None:
    """Large frames without a valid HELLO from several threads: refused from their headers
    (``invalid_argument``) or the token (``permission_denied``), never read."""
    target = ctx.data_target
    if target is None:
        return
    body = pb.EvaluateBatchRequest(
        items=[pb.EvaluateRequest(evaluator="calc", input=b"1" * 2000) for _ in range(30)]
    ).SerializeToString()
    claimed = ctx.max_message_bytes
    wrong = HELLO_MAGIC + b"not-a-token"
    attacks = (
        (HEADER.pack(claimed, Kind.BATCH) + body, ("invalid_argument",)),
        (HEADER.pack(claimed, Kind.HELLO) + body, ("invalid_argument",)),
        (
            encode_frame(Kind.HELLO, wrong) + HEADER.pack(claimed, Kind.BATCH) + body,
            ("permission_denied",),
        ),
        (encode_frame(Kind.HELLO, b"no magic") + body, ("invalid_argument",)),
    )

    def one(seed: int) -> None:
        local = random.Random(seed)
        for _ in range(3):
            frame, expected = local.choice(attacks)
            try:
                with _raw(target) as sock:
                    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                        sock.sendall(frame)
                    _expect_error(ctx, "data_unauthenticated_flood", sock, expected)
            except OSError as exc:
                ctx.recorder.add([Violation("unexpected", KLASS, f"data flood: {exc!r}")])

    threads = [
        threading.Thread(target=one, args=(rng.getrandbits(32),), name=f"fuzz-data-flood-{i}")
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _victim_served(ctx: FuzzContext, family: str) -> None:
    target = ctx.data_target
    assert target is not None
    try:
        with DataConnection.connect(target, ctx.tokens[ctx.victim]) as connection:
            connection.send(
                pb.EvaluateBatchRequest(
                    items=[pb.EvaluateRequest(evaluator="calc", input=b"17 * 23 + 91", id="v")]
                )
            )
            message = connection.receive()
    except (DataCallError, OSError) as exc:
        ctx.recorder.add([Violation("unexpected", KLASS, f"{family}: the victim failed: {exc}")])
        return
    if message is None or [r.value for r in message.results] != ["482"]:
        ctx.recorder.add(
            [Violation("unexpected", KLASS, f"{family}: the victim was not served beside it")]
        )


def data_unread_connections(ctx: FuzzContext, rng: random.Random) -> None:
    """Connections that send amplifying work and never read: the daemon holds a bounded number
    of bytes for them (the RSS bound) and serves the victim meanwhile."""
    target = ctx.data_target
    if target is None:
        return
    connections: list[DataConnection] = []
    try:
        for _ in range(rng.choice((1, 3))):
            connection = DataConnection.connect(target, ctx.tokens[ctx.attacker])
            connections.append(connection)
            for batch in range(20):
                connection.send(
                    pb.EvaluateBatchRequest(
                        items=[
                            pb.EvaluateRequest(id=f"{batch}.{i}", evaluator="strop", input=AMPLIFY)
                            for i in range(50)
                        ]
                    )
                )
        time.sleep(rng.choice((0.3, 0.8)))
        _victim_served(ctx, "data_unread_connections")
    except DataCallError as exc:
        if exc.code is not ErrorCode.QUOTA_EXCEEDED:  # its share taken by another scenario
            ctx.recorder.add([Violation("unexpected", KLASS, f"data unread: {exc}")])
    except OSError as exc:
        ctx.recorder.add([Violation("unexpected", KLASS, f"data unread: {exc}")])
    finally:
        for connection in connections:
            connection.close()
    ctx.recorder.outcome(KLASS, "ok", family="data_unread_connections")


def data_oversized_response(ctx: FuzzContext, rng: random.Random) -> None:
    """Values that add up past ``max_message_bytes`` on one connection: split into frames within
    the send limit, every item answered with its value or a typed error."""
    target = ctx.data_target
    if target is None:
        return
    count = ctx.max_message_bytes // 60_000 + rng.choice((5, 40))
    items = [pb.EvaluateRequest(evaluator="strop", input=AMPLIFY, id=str(i)) for i in range(count)]
    limit = send_limit(ctx.max_message_bytes, ctx.max_batch_items)
    results: dict[str, pb.EvaluateResponse] = {}
    try:
        with DataConnection.connect(target, ctx.tokens[ctx.victim]) as connection:
            connection.send(pb.EvaluateBatchRequest(items=items))
            while len(results) < count:
                message = connection.receive()
                if message is None:
                    break
                if message.ByteSize() > limit:
                    ctx.recorder.add(
                        [Violation("unexpected", KLASS, "a RESULTS frame over the send limit")]
                    )
                results.update((r.id, r) for r in message.results)
    except (DataCallError, OSError) as exc:
        ctx.recorder.add(
            [Violation("unexpected", KLASS, f"an oversized data-path response failed: {exc}")]
        )
        return
    if sorted(results) != sorted(str(i) for i in range(count)):
        ctx.recorder.add([Violation("missing_result", KLASS, "oversized data batch lost items")])
    for result in results.values():
        label = outcome_label(result)
        if label == "untyped":
            ctx.recorder.add(
                [Violation("untyped_error", KLASS, "an oversized data item has no code")]
            )
        ctx.recorder.outcome(KLASS, label, family="data_oversized_response")


def data_malformed_frames(ctx: FuzzContext, rng: random.Random) -> None:
    """After a valid HELLO: a corrupt protobuf, an unknown kind, a second HELLO, an oversized
    header or random bytes: ``invalid_argument`` (an ERROR frame), and the daemon serves on."""
    target = ctx.data_target
    if target is None:
        return
    frames = (
        encode_frame(Kind.BATCH, bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))),
        HEADER.pack(0, 77),
        encode_frame(Kind.HELLO, HELLO_MAGIC),
        HEADER.pack(ctx.max_message_bytes + 1, Kind.BATCH),
        encode_frame(Kind.RESULTS, b""),
    )
    frame = rng.choice(frames)
    hello = encode_frame(Kind.HELLO, HELLO_MAGIC + ctx.tokens[ctx.attacker].encode())
    try:
        with _raw(target) as sock:
            sock.sendall(hello)
            reader = sock.makefile("rb")
            ready = _read_frame(reader.read, MAX_HELLO_BYTES)
            reader.close()
            if ready is not None and ready[0] == Kind.ERROR:
                refusal = pb.Error.FromString(ready[1])
                if refusal.code == ErrorCode.QUOTA_EXCEEDED.proto_value:
                    return  # the attacker's share of connections is taken (typed): fine
            if ready is None or ready[0] != Kind.READY:
                ctx.recorder.add(
                    [Violation("unexpected", KLASS, "data path: no READY for a valid token")]
                )
                return
            sock.sendall(frame)
            _expect_error(ctx, "data_malformed_frames", sock, ("invalid_argument",))
    except OSError as exc:
        ctx.recorder.add([Violation("unexpected", KLASS, f"data malformed: {exc!r}")])
        return
    _victim_served(ctx, "data_malformed_frames")


DATA_SCENARIOS = (
    ("data_unauthenticated_flood", data_unauthenticated_flood, 0.3),
    ("data_unread_connections", data_unread_connections, 0.3),
    ("data_oversized_response", data_oversized_response, 0.3),
    ("data_malformed_frames", data_malformed_frames, 2.0),
)
"""The data path's scenarios with their weights (drawn with the gRPC ones)."""

#: Run once per run before the main loop, with the gRPC hold scenarios.
DATA_HOLD_SCENARIOS = (
    data_unauthenticated_flood,
    data_unread_connections,
    data_oversized_response,
    data_malformed_frames,
)
