"""The engine data path over a real unix socket: authentication, limits, malformed frames,
tenant isolation and fair dispatch, against a real daemon (``evald serve``)."""

from __future__ import annotations

import contextlib
import random
import re
import socket
import struct
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import TOKENS, Daemon, free_port, module, outcome, session_config, start_daemon

from evald.client import DataCallError, DataConnection
from evald.contract import HELLO_MAGIC, ErrorCode, Kind, encode_frame, pb

#: Shared by the session config's 9 tenants: each is guaranteed 2 connections.
MAX_CONNECTIONS = 18
SHARE = 2
UNAUTHENTICATED = 3


@pytest.fixture(scope="module")
def data_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("data")
    port = free_port()
    config = session_config(port).replace(
        "[server]\n",
        f'[server]\ndata_listen = "unix:{root}/data.sock"\n'
        f"data_max_connections = {MAX_CONNECTIONS}\n"
        f"data_unauthenticated_connections = {UNAUTHENTICATED}\n",
        1,
    )
    handle = start_daemon(root, config, metrics_port=port)
    try:
        yield handle
    finally:
        status = handle.stop()
        assert status == 0, handle.log_path.read_text()


def _target(daemon: Daemon) -> str:
    return f"unix:{Path(daemon.config_path).parent / 'data.sock'}"


def connect(daemon: Daemon, tenant: str | None = None) -> DataConnection:
    return DataConnection.connect(_target(daemon), TOKENS[tenant] if tenant else None)


def request(
    evaluator: str, data: bytes, request_id: str, deadline_ms: int = 0
) -> pb.EvaluateRequest:
    return pb.EvaluateRequest(
        evaluator=evaluator, input=data, id=request_id, deadline_ms=deadline_ms
    )


def round_trip(
    connection: DataConnection, *items: pb.EvaluateRequest
) -> dict[str, pb.EvaluateResponse]:
    connection.send(pb.EvaluateBatchRequest(items=items))
    results: dict[str, pb.EvaluateResponse] = {}
    while len(results) < len(items):
        message = connection.receive()
        assert message is not None, "the daemon closed the connection"
        results.update((result.id, result) for result in message.results)
    return results


def raw_socket(daemon: Daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(_target(daemon)[len("unix:") :])
    return sock


def read_error(sock: socket.socket) -> tuple[str, str]:
    """Reads frames until an ERROR frame (skipping READY/RESULTS); returns (code, message)."""
    reader = sock.makefile("rb")
    while True:
        header = reader.read(5)
        assert len(header) == 5, "the daemon closed without an ERROR frame"
        length, kind = struct.unpack("!IB", header)
        payload = reader.read(length)
        if kind == Kind.ERROR:
            error = pb.Error.FromString(payload)
            assert reader.read(1) == b"", "the daemon must close after an ERROR frame"
            return ErrorCode.from_proto(error.code).value, error.message


def still_serves(daemon: Daemon) -> None:
    with connect(daemon) as connection:
        results = round_trip(connection, request("calc", b"2 + 3", "check"))
        assert results["check"].value == "5"


def test_the_local_tenant_evaluates_like_the_grpc_stream(data_daemon: Daemon) -> None:
    with connect(data_daemon) as connection:
        assert connection.tenant == "local"
        items = [request("calc", f"{i} * 7".encode(), str(i)) for i in range(20)]
        results = round_trip(connection, *items, request("calc", b"1 +", "bad"))
    grpc_results = data_daemon.client().evaluate_batch([("calc", f"{i} * 7") for i in range(20)])
    assert [results[str(i)].value for i in range(20)] == [r.value for r in grpc_results]
    assert results["3"].semantics_version == "calc/1" and results["3"].fuel_used > 0
    assert outcome(results["bad"]) == "syntax"  # an evaluation error is a value, as on gRPC


def test_a_token_picks_its_tenant_and_a_wrong_one_is_refused(data_daemon: Daemon) -> None:
    with connect(data_daemon, "alpha") as connection:
        assert connection.tenant == "alpha"
        results = round_trip(connection, request("strop", b'upper("a")', "s"))
        assert outcome(results["s"]) == "permission_denied"  # alpha may use calc only
    with pytest.raises(DataCallError) as refused:
        DataConnection.connect(_target(data_daemon), "not-a-token")
    assert refused.value.code is ErrorCode.PERMISSION_DENIED
    assert "matches no tenant" in refused.value.message
    still_serves(data_daemon)


def test_nothing_is_read_before_the_hello_and_it_is_bounded(data_daemon: Daemon) -> None:
    # A BATCH before the HELLO.
    with raw_socket(data_daemon) as sock:
        sock.sendall(encode_frame(Kind.BATCH, b""))
        code, message = read_error(sock)
    assert code == "invalid_argument" and "HELLO" in message
    # A HELLO that claims to be huge: refused from its header, the payload is never awaited.
    with raw_socket(data_daemon) as sock:
        sock.sendall(struct.pack("!IB", 100 * 1024 * 1024, Kind.HELLO))
        started = time.monotonic()
        code, message = read_error(sock)
    assert code == "invalid_argument" and "over this connection's limit of 1024" in message
    assert time.monotonic() - started < 4.0  # well before the HELLO timeout
    # A HELLO without the magic.
    with raw_socket(data_daemon) as sock:
        sock.sendall(encode_frame(Kind.HELLO, b"hello daemon"))
        code, _ = read_error(sock)
    assert code == "invalid_argument"
    still_serves(data_daemon)


def test_a_slow_hello_is_cut_off_at_the_hello_timeout(data_daemon: Daemon) -> None:
    # A byte now and then (each well within any per-read timeout) must not keep it open.
    with raw_socket(data_daemon) as sock:
        started = time.monotonic()
        for byte in struct.pack("!IB", 20, Kind.HELLO)[:4]:
            sock.sendall(bytes([byte]))
            time.sleep(1.5)
        code, message = read_error(sock)
    assert code == "permission_denied" and "no HELLO frame" in message
    assert 4.5 <= time.monotonic() - started < 9.0  # the 5 s of HELLO_TIMEOUT_S, once
    still_serves(data_daemon)


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (encode_frame(Kind.BATCH, b"\xff\xff\xff"), "not a valid evald.v1.EvaluateBatchRequest"),
        (struct.pack("!IB", 0, 77), "unknown frame kind 77"),
        (encode_frame(Kind.HELLO, HELLO_MAGIC), "expected a BATCH frame, got HELLO"),
        (struct.pack("!IB", 2**31, Kind.BATCH), "over this connection's limit"),
        (
            encode_frame(
                Kind.BATCH,
                pb.EvaluateBatchRequest(
                    items=[request("calc", b"1", str(i)) for i in range(101)]
                ).SerializeToString(),
            ),
            "over the daemon's max_batch_items of 100",
        ),
    ],
    ids=["corrupt-protobuf", "unknown-kind", "second-hello", "oversized", "too-many-items"],
)
def test_a_malformed_frame_gets_a_typed_error_and_the_daemon_keeps_serving(
    data_daemon: Daemon, frame: bytes, expected: str
) -> None:
    with raw_socket(data_daemon) as sock:
        sock.sendall(encode_frame(Kind.HELLO, HELLO_MAGIC))
        # a good message first: it is answered before the error ends the connection
        good = pb.EvaluateBatchRequest(items=[request("calc", b"6 * 7", "good")])
        sock.sendall(encode_frame(Kind.BATCH, good.SerializeToString()) + frame)
        code, message = read_error(sock)
    assert code == "invalid_argument"
    assert expected in message
    still_serves(data_daemon)


def test_each_tenants_limits_hold_on_the_data_path(data_daemon: Daemon) -> None:
    with connect(data_daemon, "limits") as connection:
        limits = connection
        data_daemon.client("limits").register(module("echo", "dp_echo"), replace=True)
        results = round_trip(
            limits, request("dp_echo", b"x" * 1001, "big"), request("dp_echo", b"ok", "small")
        )
    assert (
        outcome(results["big"]) == "input_too_large"
        and "1000 bytes" in results["big"].error.message
    )
    assert results["small"].value == "ok"
    # max_concurrency = 2: a burst of slow items is admitted two at a time, the rest refused
    data_daemon.client("narrow").register(module("loop", "dp_narrow_loop"), replace=True)
    with connect(data_daemon, "narrow") as connection:
        items = [request("dp_narrow_loop", b"", str(i), deadline_ms=30) for i in range(5)]
        connection.send(pb.EvaluateBatchRequest(items=items))
        first = connection.receive()
        assert first is not None
        # the refusals go out at once, not after the admitted items have run for 30 ms
        assert [outcome(r) for r in first.results] == ["quota_exceeded"] * 3
        results = {r.id: r for r in first.results}
        while len(results) < 5:
            message = connection.receive()
            assert message is not None
            results.update((r.id, r) for r in message.results)
    outcomes = sorted(outcome(result) for result in results.values())
    assert outcomes.count("quota_exceeded") == 3, outcomes
    # a rate of 0.01/s with a burst of 3
    data_daemon.client("metered").register(module("echo", "dp_metered"), replace=True)
    with connect(data_daemon, "metered") as connection:
        results = round_trip(connection, *[request("dp_metered", b"m", str(i)) for i in range(5)])
    assert sorted(outcome(result) for result in results.values()).count("quota_exceeded") >= 2


def test_tenants_do_not_see_each_others_modules(data_daemon: Daemon) -> None:
    data_daemon.client("alpha").register(module("echo", "dp_private"), replace=True)
    with connect(data_daemon, "alpha") as connection:
        assert round_trip(connection, request("dp_private", b"mine", "a"))["a"].value == "mine"
    with connect(data_daemon, "beta") as connection:
        result = round_trip(connection, request("dp_private", b"yours?", "b"))["b"]
    assert outcome(result) == "unknown_evaluator"


def test_a_fast_result_is_not_held_back_by_a_slow_one_of_its_message(
    data_daemon: Daemon,
) -> None:
    # nofuel holds one worker (max_running = threads - 1): the fast item runs first, then the
    # slow one for its whole deadline. The fast result must come in a frame of its own.
    data_daemon.client("nofuel").register(module("loop", "dp_slow"), replace=True)
    data_daemon.client("nofuel").register(module("echo", "dp_fast"), replace=True)
    with connect(data_daemon, "nofuel") as connection:
        connection.send(
            pb.EvaluateBatchRequest(
                items=[request("dp_fast", b"quick", "fast"), request("dp_slow", b"", "slow")]
            )
        )
        first = connection.receive()
        assert first is not None
        assert [result.id for result in first.results] == ["fast"]
        second = connection.receive()
        assert second is not None
        assert [(r.id, outcome(r)) for r in second.results] == [("slow", "deadline_exceeded")]


def test_a_tenant_that_does_not_read_stalls_only_itself(data_daemon: Daemon) -> None:
    greedy = connect(data_daemon)
    try:
        message = pb.EvaluateBatchRequest(
            items=[request("calc", b"1 + 1", str(i)) for i in range(100)]
        )
        for _ in range(200):  # 20,000 results it never reads: its backlog stops its reader
            greedy.send(message)
        with connect(data_daemon, "beta") as other:
            started = time.monotonic()
            assert round_trip(other, request("calc", b"2 * 21", "x"))["x"].value == "42"
            assert time.monotonic() - started < 5.0
    finally:
        greedy.close()
    still_serves(data_daemon)


def _connect_retrying(daemon: Daemon) -> DataConnection:
    """A connection, once the daemon has noticed that earlier tests closed theirs."""
    give_up = time.monotonic() + 10
    while True:
        try:
            return connect(daemon)
        except DataCallError:
            assert time.monotonic() < give_up
            time.sleep(0.05)


def test_a_tenant_holds_at_most_its_share_of_the_connections(data_daemon: Daemon) -> None:
    open_connections = [_connect_retrying(data_daemon) for _ in range(SHARE)]
    try:
        with pytest.raises(DataCallError) as refused:
            connect(data_daemon)
        assert refused.value.code is ErrorCode.QUOTA_EXCEEDED
        assert "data_max_connections" in refused.value.message
        # Its share is its own limit: another tenant still connects.
        with connect(data_daemon, "beta") as other:
            assert round_trip(other, request("calc", b"6 * 7", "b"))["b"].value == "42"
    finally:
        for connection in open_connections:
            connection.close()
    with _connect_retrying(data_daemon) as connection:  # the daemon noticed the closed ones
        assert round_trip(connection, request("calc", b"2 + 3", "again"))["again"].value == "5"


def test_connections_are_counted_in_the_rpc_metric(data_daemon: Daemon) -> None:
    still_serves(data_daemon)
    with pytest.raises(DataCallError):
        DataConnection.connect(_target(data_daemon), "wrong")
    url = f"http://127.0.0.1:{data_daemon.metrics_port}/metrics"
    give_up = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        ok = re.search(
            r'evald_rpcs_total\{code="ok",method="DataStream",tenant="local"\} (\S+)', text
        )
        denied = re.search(
            r'evald_rpcs_total\{code="permission_denied",method="DataStream",'
            r'tenant="unauthenticated"\} (\S+)',
            text,
        )
        if ok and denied:
            break
        assert time.monotonic() < give_up, text
        time.sleep(0.05)
    assert float(ok.group(1)) >= 1 and float(denied.group(1)) >= 1


def test_shutdown_answers_what_is_running_then_says_unavailable(tmp_path: Path) -> None:
    config = (
        f'[server]\ndata_listen = "unix:{tmp_path}/data.sock"\nshutdown_grace_s = 5\n'
        '[[tenants]]\nname = "local"\nevaluators = ["*"]\nallow_register = true\n'
        "[tenants.limits]\nfuel = 0\ndeadline_ms = 300\n"
    )
    handle = start_daemon(tmp_path, config)
    try:
        handle.client().register(module("loop", "dp_shutdown_loop"))
        connection = DataConnection.connect(f"unix:{tmp_path}/data.sock")
        connection.send(pb.EvaluateBatchRequest(items=[request("dp_shutdown_loop", b"", "run")]))
        time.sleep(0.1)  # admitted and running
    finally:
        status = handle.stop()
    assert status == 0, handle.log_path.read_text()
    message = connection.receive()  # the running item was answered before the end
    assert message is not None
    assert [(r.id, outcome(r)) for r in message.results] == [("run", "deadline_exceeded")]
    with pytest.raises(DataCallError) as ended:
        connection.receive()
    assert ended.value.code is ErrorCode.UNAVAILABLE and "shutting down" in ended.value.message
    connection.close()
    assert not (tmp_path / "data.sock").exists()


def test_a_tenant_flooding_slow_items_leaves_a_worker_for_another(data_daemon: Daemon) -> None:
    # nofuel holds at most one of the two workers (max_running = threads - 1): its ten slow
    # items take ten deadlines (500 ms) one after another, and beta's item, sent after them on
    # its own connection, runs on the other worker at once.
    data_daemon.client("nofuel").register(module("loop", "dp_flood"), replace=True)
    with connect(data_daemon, "nofuel") as flooder, connect(data_daemon, "beta") as other:
        flooder.send(
            pb.EvaluateBatchRequest(items=[request("dp_flood", b"", str(i)) for i in range(10)])
        )
        time.sleep(0.06)  # the flood is admitted and running
        started = time.monotonic()
        answer = round_trip(other, request("calc", b"6 * 7", "mine"))["mine"]
        waited = time.monotonic() - started
        flooded: dict[str, pb.EvaluateResponse] = {}
        while len(flooded) < 10:
            message = flooder.receive()
            assert message is not None
            flooded.update((r.id, r) for r in message.results)
    assert answer.value == "42"
    assert waited < 0.3, waited  # not behind the flood's remaining ~440 ms
    assert {outcome(r) for r in flooded.values()} == {"deadline_exceeded"}


def _mutated(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        choice = rng.random()
        if choice < 0.4 and out:
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif choice < 0.7:
            out.insert(rng.randrange(len(out) + 1), rng.randrange(256))
        elif out:
            del out[rng.randrange(len(out))]
    return bytes(out)


def _random_connection_bytes(rng: random.Random) -> bytes:
    """A HELLO (usually), then a mix of good, mutated, oversized and garbage frames, maybe cut."""
    good = pb.EvaluateBatchRequest(items=[request("calc", b"1 + 2", "g")]).SerializeToString()
    parts = [encode_frame(Kind.HELLO, HELLO_MAGIC)] if rng.random() < 0.8 else []
    for _ in range(rng.randint(0, 5)):
        choice = rng.random()
        if choice < 0.3:
            parts.append(encode_frame(Kind.BATCH, _mutated(good, rng)))
        elif choice < 0.5:
            parts.append(encode_frame(Kind.BATCH, good))
        elif choice < 0.6:
            length = rng.choice([0, 1, 5, 1025, 2**31, 2**32 - 1])
            parts.append(struct.pack("!IB", length, rng.randrange(256)))
        elif choice < 0.8:
            parts.append(rng.randbytes(rng.randrange(1, 64)))
        else:
            items = [
                request(
                    rng.choice(["calc", "strop", "nope", ""]),
                    rng.randbytes(rng.randrange(30)),
                    str(i),
                    deadline_ms=rng.choice([0, 1, 100, 10**9]),
                )
                for i in range(rng.randint(0, 20))
            ]
            parts.append(
                encode_frame(Kind.BATCH, pb.EvaluateBatchRequest(items=items).SerializeToString())
            )
    data = b"".join(parts)
    return data[: rng.randrange(len(data))] if data and rng.random() < 0.3 else data


def test_random_frames_never_break_the_daemon(data_daemon: Daemon) -> None:
    rng = random.Random(16)
    for _ in range(150):
        with raw_socket(data_daemon) as sock:
            with contextlib.suppress(OSError):
                sock.sendall(_random_connection_bytes(rng))
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):  # the daemon answers, then closes
                    pass
    still_serves(data_daemon)
    failures = [
        line
        for line in data_daemon.log_lines()
        if line.get("level") in ("error", "critical") or line.get("code") == "internal"
    ]
    assert not failures, failures[:3]
