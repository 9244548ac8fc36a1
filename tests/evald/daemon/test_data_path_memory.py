"""What a caller can make the daemon hold through the data path, against a real daemon.

The same classes as tests/evald/daemon/test_server_memory.py, on the unix-socket transport:

1. Before authentication: the daemon takes at most the HELLO from an unauthenticated peer.
2. Connections that never read: unread output is bounded in bytes per connection
   (``stream_unread_bytes``) and per tenant (``unread_bytes``, shared with its gRPC streams;
   ``strop`` ``replace`` turns 6 KB of input into a 60 KB value), and a connection whose client
   reads nothing for ``stream_stall_s`` is cut off with ``quota_exceeded``.
3. Oversized responses: results are split into frames within ``max_message_bytes``; a value
   larger than a whole frame becomes its own ``output_too_large``.
4. Per-tenant caps: a connection is one call of its tenant's ``max_calls``.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from daemon_harness import TOKENS, Daemon, module, outcome, start_daemon, tenant_block

from evald.client import DataCallError, DataConnection
from evald.contract import HEADER, ErrorCode, Kind, pb, pb_grpc
from evald.daemon import send_limit
from evald.testing import arg

MIB = 2**20
#: 6,000 characters of input, a 60,002-byte value.
_AMPLIFY = b'replace("' + b"a" * 6000 + b'", "a", "aaaaaaaaaa")'
_STREAM_UNREAD = 2 * MIB
_TENANT_UNREAD = 4 * MIB
#: The smallest message budget: one 60 KB value a frame, a larger one past it.
_MAX_MESSAGE = 64 * 1024
_MAX_BATCH = 4096


def _config(data_socket: Path) -> str:
    return "\n".join(
        [
            "[server]",
            "threads = 2",
            f"max_batch_items = {_MAX_BATCH}",
            f"max_message_bytes = {_MAX_MESSAGE}",
            f"stream_unread_bytes = {_STREAM_UNREAD}",
            "stream_stall_s = 1.0",
            "shutdown_grace_s = 2",
            f'data_listen = "unix:{data_socket}"',
            "data_max_connections = 16",
            tenant_block("alpha", evaluators=["*"], limits={"max_concurrency": 20000}),
            tenant_block(
                "beta",
                evaluators=["*"],
                limits={"max_concurrency": 20000, "unread_bytes": _TENANT_UNREAD},
            ),
            tenant_block("narrow", evaluators=["calc"], limits={"max_calls": 2}),
            # Values past a whole frame (the harness's tokens name the tenants).
            tenant_block(
                "viewer",
                evaluators=["*"],
                allow_register=True,
                limits={"output_bytes": "1MiB"},
            ),
        ]
    )


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str]]:
    root = tmp_path_factory.mktemp("datamem")
    data_socket = root / "data.sock"
    handle = start_daemon(root, _config(data_socket))
    try:
        yield handle, f"unix:{data_socket}"
    finally:
        assert handle.stop() == 0, Path(handle.log_path).read_text()


def _rss(handle: Daemon) -> int:
    rss = handle.rss_bytes()
    assert rss is not None, "the daemon died"
    return rss


def _connect(target: str, tenant: str) -> DataConnection:
    return DataConnection.connect(target, TOKENS[tenant])


def _calc_ok(target: str, tenant: str = "alpha") -> None:
    with _connect(target, tenant) as connection:
        connection.send(
            pb.EvaluateBatchRequest(
                items=[pb.EvaluateRequest(evaluator="calc", input=b"17 * 23 + 91", id="c")]
            )
        )
        message = connection.receive()
        assert message is not None
        assert [(r.id, r.value) for r in message.results] == [("c", "482")]


def _amplifying(batch: int, items: int = 10) -> pb.EvaluateBatchRequest:
    return pb.EvaluateBatchRequest(
        items=[
            pb.EvaluateRequest(id=f"{batch}.{i}", evaluator="strop", input=_AMPLIFY)
            for i in range(items)
        ]
    )


def _raw(target: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(target[len("unix:") :])
    return sock


def test_an_unauthenticated_flood_costs_the_daemon_nothing(daemon: tuple[Daemon, str]) -> None:
    handle, target = daemon
    before = _rss(handle)
    failures: list[str] = []
    # Frames that claim 8 MB (a BATCH before the HELLO, an oversized HELLO, a HELLO with a
    # wrong token followed by a batch), 200 KB of them sent each time.
    body = pb.EvaluateBatchRequest(
        items=[pb.EvaluateRequest(evaluator="calc", input=b"1" * 2000) for _ in range(100)]
    ).SerializeToString()
    wrong = b"evald-data/1\nnot-a-token"
    attacks = (
        HEADER.pack(8 * MIB, Kind.BATCH) + body,
        HEADER.pack(8 * MIB, Kind.HELLO) + body,
        HEADER.pack(len(wrong), Kind.HELLO) + wrong + HEADER.pack(8 * MIB, Kind.BATCH) + body,
    )

    def attack(index: int) -> None:
        for attempt in range(15):
            try:
                with _raw(target) as sock:
                    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                        sock.sendall(attacks[(index + attempt) % len(attacks)])
                    reply = sock.recv(HEADER.size)
                    if reply and reply[4] != Kind.ERROR:
                        failures.append(f"an unauthenticated peer got frame kind {reply[4]}")
            except OSError as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=attack, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    peak = before
    while any(thread.is_alive() for thread in threads):
        peak = max(peak, _rss(handle))
        time.sleep(0.02)
    assert failures == []
    assert peak - before < 16 * MIB, (before, peak)
    print("unauthenticated data-path flood: daemon RSS", before // MIB, "->", peak // MIB, "MiB")
    _calc_ok(target)


def test_connections_that_never_read_hold_bounded_output(daemon: tuple[Daemon, str]) -> None:
    handle, target = daemon
    before = _rss(handle)
    connections = [_connect(target, "beta") for _ in range(3)]
    try:
        # 3 x 3,000 items of 60 KB of output: 540 MB if the daemon held them all.
        for connection in connections:
            for batch in range(300):
                connection.send(_amplifying(batch))
        peak = before
        deadline = time.monotonic() + 0.9  # under stream_stall_s: the connections still live
        while time.monotonic() < deadline:
            peak = max(peak, _rss(handle))
            time.sleep(0.05)
        # The tenant's bound (4 MiB) over all three connections, the socket buffers, the
        # requests read and waiting, and the allocator's slack.
        assert peak - before < 64 * MIB, (before, peak)
        print("non-reading data connections: daemon RSS", before // MIB, "->", peak // MIB, "MiB")
        _calc_ok(target)  # another tenant is served meanwhile
    finally:
        for connection in connections:
            connection.close()


def test_a_connection_whose_client_reads_nothing_is_cut_off(daemon: tuple[Daemon, str]) -> None:
    handle, target = daemon

    def cut_lines() -> list[dict[str, object]]:
        return [
            line
            for line in handle.log_lines()
            if str(line.get("msg", "")).startswith("data connection cut off")
        ]

    before = len(cut_lines())
    connection = _connect(target, "alpha")
    try:
        for batch in range(300):
            connection.send(_amplifying(batch))
        # the daemon's log says when it cut the connection off; the time it may take is not
        # the point (beside two CPU hogs 15 s was not enough to compute the 300 batches)
        give_up = time.monotonic() + 120
        while len(cut_lines()) == before:  # well past stream_stall_s (1 s) without reading
            assert time.monotonic() < give_up, "the stalled connection was never cut off"
            time.sleep(0.1)
        assert cut_lines()[-1]["tenant"] == "alpha"
        received = 0
        ended: DataCallError | None = None
        with contextlib.suppress(OSError):
            while True:
                try:
                    message = connection.receive()
                except DataCallError as exc:
                    ended = exc
                    break
                if message is None:
                    break
                received += len(message.results)
        assert received < 3000
        if ended is not None:  # the ERROR frame went out when the buffer had room for it
            assert ended.code in (ErrorCode.QUOTA_EXCEEDED, ErrorCode.INTERNAL)
    finally:
        connection.close()
    # alpha's budget is whole again: a connection that reads gets everything.
    with _connect(target, "alpha") as reading:
        for batch in range(20):
            reading.send(_amplifying(batch))
        ids: set[str] = set()
        while len(ids) < 200:
            message = reading.receive()
            assert message is not None
            for result in message.results:
                assert outcome(result) == "ok", result.error
                ids.add(result.id)


def test_results_are_split_into_frames_within_the_message_budget(
    daemon: tuple[Daemon, str],
) -> None:
    _handle, target = daemon
    sock = _raw(target)
    with sock:
        hello = b"evald-data/1\n" + TOKENS["alpha"].encode()
        sock.sendall(HEADER.pack(len(hello), Kind.HELLO) + hello)

        def send() -> None:  # while this thread reads: the daemon sends as it goes
            for batch in range(6):  # 360 KB of values
                request = _amplifying(batch).SerializeToString()
                sock.sendall(HEADER.pack(len(request), Kind.BATCH) + request)
            sock.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        reader = sock.makefile("rb")
        sizes: list[int] = []
        ids: set[str] = set()
        while True:
            header = reader.read(HEADER.size)
            if not header:
                break
            length, kind = struct.unpack("!IB", header)
            payload = reader.read(length)
            if kind == Kind.RESULTS:
                sizes.append(length)
                for result in pb.EvaluateBatchResponse.FromString(payload).results:
                    assert outcome(result) == "ok", result.error
                    ids.add(result.id)
            else:
                assert kind == Kind.READY, (kind, payload)
        sender.join()
    assert ids == {f"{batch}.{i}" for batch in range(6) for i in range(10)}
    assert len(sizes) == 60  # one 60 KB value a frame
    assert max(sizes) <= send_limit(_MAX_MESSAGE, _MAX_BATCH)
    assert max(sizes) <= _MAX_MESSAGE


def test_a_value_larger_than_a_frame_is_its_own_output_too_large(
    daemon: tuple[Daemon, str],
) -> None:
    _handle, target = daemon

    handle, target = daemon
    client = handle.client("viewer")
    # Input N: a value of N bytes "x".
    client.register(module("output", "dp_output", out_cap=128 * 1024), replace=True)
    items = [
        pb.EvaluateRequest(id="big0", evaluator="dp_output", input=arg(60_000)),
        pb.EvaluateRequest(id="small", evaluator="calc", input=b"2 + 3"),
        pb.EvaluateRequest(id="big1", evaluator="dp_output", input=arg(60_000)),
        pb.EvaluateRequest(id="huge", evaluator="dp_output", input=arg(90_000)),
    ]
    with _connect(target, "viewer") as connection:
        connection.send(pb.EvaluateBatchRequest(items=items))
        results: dict[str, pb.EvaluateResponse] = {}
        while len(results) < len(items):
            message = connection.receive()
            assert message is not None
            results.update((r.id, r) for r in message.results)
    assert results["small"].value == "5"
    for name in ("big0", "big1"):  # together over one frame's budget: split, not refused
        assert outcome(results[name]) == "ok", results[name].error
        assert len(results[name].value) == 60_000
    # Over a whole frame (max_message_bytes): its own typed error, the others unharmed.
    assert outcome(results["huge"]) == "output_too_large", results["huge"]
    assert "max_message_bytes" in results["huge"].error.message


def test_a_connection_counts_in_its_tenants_max_calls(daemon: tuple[Daemon, str]) -> None:
    handle, target = daemon
    first = _connect(target, "narrow")
    second = _connect(target, "narrow")
    try:
        with pytest.raises(DataCallError) as refused:
            _connect(target, "narrow")
        assert refused.value.code is ErrorCode.QUOTA_EXCEEDED
        assert "max_calls" in refused.value.message
        # The same count holds the gRPC calls back.
        with grpc.insecure_channel(handle.target) as channel:
            with pytest.raises(grpc.RpcError) as grpc_refused:
                pb_grpc.EvaluatorStub(channel).Evaluate(
                    pb.EvaluateRequest(evaluator="calc", input=b"1 + 1"),
                    timeout=10,
                    metadata=(("authorization", f"Bearer {TOKENS['narrow']}"),),
                )
            assert grpc_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    finally:
        first.close()
        second.close()
    give_up = time.monotonic() + 10
    while True:  # the daemon notices the closed connections
        try:
            _calc_ok(target, "narrow")
            break
        except DataCallError as exc:
            assert exc.code is ErrorCode.QUOTA_EXCEEDED and time.monotonic() < give_up
            time.sleep(0.05)


def test_many_non_reading_connections_leave_the_daemon_serving(
    daemon: tuple[Daemon, str],
) -> None:
    _handle, target = daemon
    stop = threading.Event()
    connections = [_connect(target, "beta") for _ in range(4)]
    try:
        for connection in connections:
            for batch in range(20):
                connection.send(_amplifying(batch))
        stop.wait(0.2)
        _calc_ok(target)
    finally:
        for connection in connections:
            connection.close()
