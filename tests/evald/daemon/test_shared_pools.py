"""What one caller can take from the others, against a real daemon (TCP and the data path).

Each test reproduces an attack at a small scale and fails on a daemon without the rule:

1. Services that need no token (health) have their own small budget of calls and read small
   requests only: health ``Watch`` streams once filled gRPC's call cap and every tenant got an
   untyped ``RESOURCE_EXHAUSTED``; 4 MB service names grew the daemon by ~16 MiB a call.
2. Shared pools have per-tenant shares: one tenant's gRPC calls or data-path connections cannot
   take another's guaranteed share; silent connections with no HELLO cannot keep a tenant out,
   nor can a peer churning connections that each send one HELLO byte (it evicts its own).
3. Bytes in flight are bounded in time and charged: a request must arrive whole within
   ``frame_timeout_s``, and a data-path frame's bytes count in the sender's ``request_bytes``.
4. Idle streams and connections are closed; the engine client reopens them without failing a
   span.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from daemon_harness import TOKENS, Daemon, free_port, start_daemon, tenant_block
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_adapter import EvaluatorClient
from evald.client import DataCallError, DataConnection
from evald.contract import (
    ERROR_CODE_METADATA_KEY,
    HEADER,
    HELLO_MAGIC,
    ErrorCode,
    Kind,
    encode_frame,
    pb,
    pb_grpc,
)
from evald.testing import HelloChurn, tenant_table

MIB = 2**20
KIB = 1024
#: Two tenants share 8 gRPC calls and 16 data-path connections: 4 and 8 each.
_CALLS = 8
_CALL_SHARE = 4
_CONNECTIONS = 16
_CONNECTION_SHARE = 8
_OPEN_CALLS = 4
_FRAME_TIMEOUT_S = 2.0
_REQUEST_BYTES = 1 * MIB


def _config(data_socket: Path, *, idle_timeout_s: float = 0.0) -> str:
    return "\n".join(
        [
            "[server]",
            "threads = 2",
            f"max_concurrent_rpcs = {_CALLS}",
            f"open_calls = {_OPEN_CALLS}",
            'open_request_bytes = "4KiB"',
            f"frame_timeout_s = {_FRAME_TIMEOUT_S}",
            f"idle_timeout_s = {idle_timeout_s}",
            "shutdown_grace_s = 2",
            f'data_listen = "unix:{data_socket}"',
            f"data_max_connections = {_CONNECTIONS}",
            "data_unauthenticated_connections = 2",
            tenant_block("alpha", evaluators=["*"], limits={"request_bytes": _REQUEST_BYTES}),
            tenant_block("beta", evaluators=["*"]),
        ]
    )


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str, str]]:
    root = tmp_path_factory.mktemp("pools")
    listen = f"127.0.0.1:{free_port()}"
    handle = start_daemon(root, _config(root / "data.sock"), listen=listen)
    try:
        yield handle, listen, f"unix:{root / 'data.sock'}"
    finally:
        assert handle.stop() == 0, Path(handle.log_path).read_text()


def _auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def _code(error: grpc.RpcError) -> str | None:
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == ERROR_CODE_METADATA_KEY:
            return str(value)
    return None


def _calc(listen: str, tenant: str) -> str:
    with grpc.insecure_channel(listen) as channel:
        response = pb_grpc.EvaluatorStub(channel).Evaluate(
            pb.EvaluateRequest(evaluator="calc", input=b"17 * 23 + 91"),
            timeout=30,
            metadata=_auth(tenant),
        )
    return str(response.value)


def _rss(handle: Daemon) -> int:
    rss = handle.rss_bytes()
    assert rss is not None, "the daemon died"
    return rss


# 1. Services that need no token ----------------------------------------------------------


def test_health_watch_streams_cannot_starve_tenants(daemon: tuple[Daemon, str, str]) -> None:
    _handle, listen, _data = daemon
    channel = grpc.insecure_channel(listen)
    watches = []
    try:
        health = health_pb2_grpc.HealthStub(channel)
        served, refused = 0, []
        for _ in range(3 * _CALLS):  # more than gRPC's call cap used to be, and open_calls
            watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=60)
            watches.append(watch)
            try:
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
                served += 1
            except grpc.RpcError as error:
                refused.append((error.code(), _code(error)))  # type: ignore[attr-defined]
        assert served == _OPEN_CALLS // 2  # streams take half: probes' Checks get the rest
        assert set(refused) == {(grpc.StatusCode.UNAVAILABLE, "unavailable")}, refused
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1
        # The open Watch streams hold none of the tenants' room.
        for tenant in ("alpha", "beta"):
            assert _calc(listen, tenant) == "482"
    finally:
        for watch in watches:
            watch.cancel()
        channel.close()


def test_open_services_read_small_requests_only(daemon: tuple[Daemon, str, str]) -> None:
    handle, listen, _data = daemon
    with grpc.insecure_channel(listen, options=[("grpc.max_send_message_length", 8 * MIB)]) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        # A probe's request is tiny; anything over open_request_bytes is refused, typed.
        with pytest.raises(grpc.RpcError) as check:
            health.Check(health_pb2.HealthCheckRequest(service="s" * (64 * KIB)), timeout=30)
        assert _code(check.value) == "invalid_argument"
        assert "open_request_bytes" in check.value.details()  # type: ignore[attr-defined]
        before = _rss(handle)
        for index in range(8):  # each once held ~16 MiB for as long as the stream stayed open
            watch = health.Watch(
                health_pb2.HealthCheckRequest(service=f"{index}" * (4 * MIB)), timeout=30
            )
            with pytest.raises(grpc.RpcError) as refused:
                next(watch)
            assert _code(refused.value) == "invalid_argument"
        grown = _rss(handle) - before
        assert grown < 64 * MIB, grown
        print("8 Watch calls with 4 MB names: daemon RSS +", grown // MIB, "MiB")
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1
    assert _calc(listen, "alpha") == "482"


# 2. Shares of the shared pools ------------------------------------------------------------


def _open_stream(channel: grpc.Channel, tenant: str) -> object:
    """An EvaluateStream that the daemon has answered once (so it counts), kept open."""
    ready = threading.Event()
    done = threading.Event()

    def requests() -> Iterator[pb.EvaluateBatchRequest]:
        yield pb.EvaluateBatchRequest(
            items=[pb.EvaluateRequest(evaluator="calc", input=b"1 + 1", id="x")]
        )
        ready.wait(60)
        done.wait(60)

    call = pb_grpc.EvaluatorStub(channel).EvaluateStream(
        requests(), timeout=60, metadata=_auth(tenant)
    )
    first = next(call)
    assert [r.value for r in first.results] == ["2"]
    ready.set()
    call.add_done_callback(lambda _call: done.set())
    return call


def test_a_tenant_holds_only_its_share_of_grpc_calls(daemon: tuple[Daemon, str, str]) -> None:
    _handle, listen, _data = daemon
    channel = grpc.insecure_channel(listen)
    streams = []
    try:
        for _ in range(_CALL_SHARE):
            streams.append(_open_stream(channel, "alpha"))
        with pytest.raises(grpc.RpcError) as refused:
            _open_stream(channel, "alpha")
        assert _code(refused.value) == "quota_exceeded"
        assert "max_concurrent_rpcs" in refused.value.details()  # type: ignore[attr-defined]
        assert _calc(listen, "beta") == "482"  # its share is intact
    finally:
        for stream in streams:
            stream.cancel()  # type: ignore[attr-defined]
        channel.close()
    give_up = time.monotonic() + 10
    while True:  # the daemon notices the cancelled streams
        try:
            assert _calc(listen, "alpha") == "482"
            break
        except grpc.RpcError as error:
            assert _code(error) == "quota_exceeded" and time.monotonic() < give_up
            time.sleep(0.05)


def _connect_retrying(target: str, tenant: str) -> DataConnection:
    give_up = time.monotonic() + 10
    while True:
        try:
            return DataConnection.connect(target, TOKENS[tenant])
        except DataCallError:
            assert time.monotonic() < give_up
            time.sleep(0.05)


def _data_calc(connection: DataConnection) -> str:
    connection.send(
        pb.EvaluateBatchRequest(items=[pb.EvaluateRequest(evaluator="calc", input=b"6 * 7")])
    )
    message = connection.receive()
    assert message is not None
    return str(message.results[0].value)


def test_a_tenant_holds_only_its_share_of_data_connections(
    daemon: tuple[Daemon, str, str],
) -> None:
    _handle, _listen, target = daemon
    held = [_connect_retrying(target, "alpha") for _ in range(_CONNECTION_SHARE)]
    try:
        with pytest.raises(DataCallError) as refused:
            DataConnection.connect(target, TOKENS["alpha"])
        assert refused.value.code is ErrorCode.QUOTA_EXCEEDED
        assert "data_max_connections" in refused.value.message
        with _connect_retrying(target, "beta") as other:
            assert _data_calc(other) == "42"
    finally:
        for connection in held:
            connection.close()


def test_silent_connections_cannot_keep_a_tenant_out(daemon: tuple[Daemon, str, str]) -> None:
    _handle, _listen, target = daemon
    silent: list[socket.socket] = []
    try:
        for _ in range(2 * _CONNECTIONS):  # once, these filled data_max_connections
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(target[len("unix:") :])
            silent.append(sock)
        time.sleep(0.5)  # past the grace a connection has to send its HELLO
        started = time.monotonic()
        with DataConnection.connect(target, TOKENS["beta"]) as connection:
            assert _data_calc(connection) == "42"
        assert time.monotonic() - started < 3.0  # not after the 5 s HELLO timeout
    finally:
        for sock in silent:
            sock.close()


def test_silent_connections_reopened_faster_than_the_grace_cannot_keep_a_tenant_out(
    daemon: tuple[Daemon, str, str],
) -> None:
    """A peer that keeps opening silent connections, each younger than the HELLO grace, once
    kept the pool of unauthenticated connections full: every client was refused."""
    _handle, _listen, target = daemon
    path = target[len("unix:") :]
    stop = threading.Event()
    opened = 0

    def flood() -> None:
        nonlocal opened
        held: list[socket.socket] = []
        while not stop.is_set():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with contextlib.suppress(OSError):
                sock.connect(path)
                opened += 1
            held.append(sock)
            if len(held) > 256:  # each kept open ~0.5 s, past the grace, unless evicted
                held.pop(0).close()
            time.sleep(0.002)  # 500 a second: many more than the pool within the grace
        for sock in held:
            sock.close()

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        while opened < 20:
            time.sleep(0.01)
        for _ in range(5):
            with DataConnection.connect(target, TOKENS["beta"]) as connection:
                assert _data_calc(connection) == "42"
    finally:
        stop.set()
        thread.join(10)
    assert opened > 20


def test_a_peer_churning_half_sent_hellos_cannot_keep_a_tenant_out(
    daemon: tuple[Daemon, str, str],
) -> None:
    """A token-less peer churning connections that each send one HELLO byte kept every
    unauthenticated slot within its grace: a tenant was refused ``unavailable`` 33 times of 40.
    Slots are paid for by the peer process holding them, so the flood evicts its own."""
    _handle, _listen, target = daemon
    refused: list[ErrorCode] = []
    with HelloChurn(target[len("unix:") :]) as flood:
        time.sleep(0.5)  # the flood is under way
        for _ in range(40):
            try:
                with DataConnection.connect(target, TOKENS["beta"]) as connection:
                    assert _data_calc(connection) == "42"
            except DataCallError as error:
                refused.append(error.code)
        assert flood.running(), "the flood ended before the clients did"
    assert flood.opened > 100, "the flood did not churn"
    assert refused == []


# 3. Bytes in flight: bounded in time, charged to the sender --------------------------------


def _hello(target: str, tenant: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(target[len("unix:") :])
    sock.sendall(encode_frame(Kind.HELLO, HELLO_MAGIC + TOKENS[tenant].encode()))
    kind, _payload = _read_frame(sock)
    assert kind is Kind.READY
    return sock


def _read_frame(sock: socket.socket) -> tuple[Kind, bytes]:
    def exactly(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = sock.recv(size - len(data))
            assert chunk, "closed"
            data += chunk
        return data

    length, kind = HEADER.unpack(exactly(HEADER.size))
    return Kind(kind), exactly(length)


def test_a_data_frame_must_arrive_within_its_deadline(daemon: tuple[Daemon, str, str]) -> None:
    _handle, _listen, target = daemon
    sock = _hello(target, "alpha")
    try:
        length = 512 * KIB
        sock.sendall(HEADER.pack(length, Kind.BATCH) + b"\0" * (length - 1))  # one byte short
        started = time.monotonic()
        kind, payload = _read_frame(sock)
        waited = time.monotonic() - started
        assert kind is Kind.ERROR
        error = pb.Error.FromString(payload)
        assert error.code == ErrorCode.QUOTA_EXCEEDED.proto_value
        assert "frame_timeout_s" in error.message
        assert _FRAME_TIMEOUT_S - 0.5 < waited < _FRAME_TIMEOUT_S + 10
    finally:
        sock.close()


def _unread_by_peer(sock: socket.socket) -> int:
    """Bytes ``sock`` sent that its peer has not read yet (``SIOCOUTQ``: a unix socket's sent
    bytes stay charged to the sender until the receiver reads them)."""
    out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4)
    return int(struct.unpack("i", out)[0])


def test_a_data_frames_bytes_count_in_the_senders_budget(
    daemon: tuple[Daemon, str, str],
) -> None:
    _handle, _listen, target = daemon
    # alpha's request_bytes is 1 MiB: a frame of 900 KiB that is still arriving holds most of
    # it, so alpha's next frame of 200 KiB waits until the first ends (its deadline).
    stalled = _hello(target, "alpha")
    waiting = _connect_retrying(target, "alpha")
    events: list[str] = []
    try:
        sent_at = time.monotonic()  # the stalled frame's deadline is later than this + timeout
        stalled.sendall(HEADER.pack(900 * KIB, Kind.BATCH) + b"\0" * KIB)
        # The daemon has read the header (so its reader reserves the 900 KiB next), whatever
        # the machine's load; then a margin for that reservation.
        until_read = time.monotonic() + 30
        while _unread_by_peer(stalled) > 0:
            assert time.monotonic() < until_read, "the daemon never read the stalled header"
            time.sleep(0.01)
        time.sleep(0.2)
        waiting.send(
            pb.EvaluateBatchRequest(
                items=[
                    pb.EvaluateRequest(evaluator="calc", input=b"1" + b" " * (100 * KIB), id="a"),
                    pb.EvaluateRequest(evaluator="calc", input=b"2" + b" " * (100 * KIB), id="b"),
                ]
            )
        )
        ending: list[tuple[Kind, bytes]] = []
        ended = threading.Thread(
            target=lambda: (ending.append(_read_frame(stalled)), events.append("stalled ended"))
        )
        ended.start()
        with _connect_retrying(target, "beta") as other:  # another tenant is not charged
            assert _data_calc(other) == "42"
            events.append("beta answered")
        answered: list[tuple[str, str]] = []
        while len(answered) < 2:  # in one RESULTS frame or two
            message = waiting.receive()
            assert message is not None
            answered += [(r.id, r.value) for r in message.results]
        answered_after_s = time.monotonic() - sent_at
        ended.join(30)
        assert sorted(answered) == [("a", "1"), ("b", "2")]
        # beta went first, while alpha's budget was held (the stalled frame ends at its 2 s
        # deadline; beta's one small item is not charged to alpha).
        assert events[0] == "beta answered", events
        assert len(ending) == 1 and ending[0][0] is Kind.ERROR, ending
        # alpha's second frame was admitted only once the stalled frame's deadline had passed
        # (the daemon frees those bytes then): a lower bound that a busy machine only lengthens.
        assert answered_after_s >= _FRAME_TIMEOUT_S, answered_after_s
    finally:
        stalled.close()
        waiting.close()


def test_slow_frames_hold_bounded_memory(daemon: tuple[Daemon, str, str]) -> None:
    """Six connections each send the header of an 8 MiB frame and all but one byte of it: the
    tenant's request_bytes (1 MiB) lets the daemon read one such payload at a time; the others'
    bytes stay with their senders (once, all six were read in and held)."""
    handle, _listen, target = daemon
    length = 8 * MIB - 64 * KIB
    sockets = [_hello(target, "alpha") for _ in range(6)]
    before = _rss(handle)
    peak = before

    def send(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.sendall(HEADER.pack(length, Kind.BATCH) + b"\0" * (length - 1))

    senders = [threading.Thread(target=send, args=(sock,), daemon=True) for sock in sockets]
    try:
        for sender in senders:
            sender.start()
        give_up = time.monotonic() + _FRAME_TIMEOUT_S * 0.75
        while time.monotonic() < give_up:
            peak = max(peak, _rss(handle))
            time.sleep(0.02)
    finally:
        for sock in sockets:
            sock.close()
    grown = peak - before
    print("six stalled 8 MiB frames: daemon RSS +", grown // MIB, "MiB")
    assert grown < 24 * MIB, grown


def test_a_unary_request_must_arrive_within_its_deadline(daemon: tuple[Daemon, str, str]) -> None:
    _handle, listen, _data = daemon
    never = threading.Event()

    def no_message() -> Iterator[bytes]:
        never.wait(30)
        yield b""

    with grpc.insecure_channel(listen) as channel:
        for method, metadata in (
            ("/evald.v1.Evaluator/Evaluate", _auth("alpha")),
            ("/grpc.health.v1.Health/Check", ()),
        ):
            call = channel.stream_unary(method)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                call(no_message(), timeout=20, metadata=metadata)
            assert _code(refused.value) == "quota_exceeded", refused.value
            assert "frame_timeout_s" in refused.value.details()  # type: ignore[attr-defined]
            assert time.monotonic() - started < _FRAME_TIMEOUT_S + 10
    never.set()
    assert _calc(listen, "alpha") == "482"


# 4. Idle streams and connections -----------------------------------------------------------


@pytest.fixture(scope="module")
def idle_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str, str]]:
    root = tmp_path_factory.mktemp("idle")
    listen = f"127.0.0.1:{free_port()}"
    handle = start_daemon(root, _config(root / "data.sock", idle_timeout_s=1.0), listen=listen)
    try:
        yield handle, listen, f"unix:{root / 'data.sock'}"
    finally:
        assert handle.stop() == 0, Path(handle.log_path).read_text()


def test_idle_streams_and_connections_are_closed(idle_daemon: tuple[Daemon, str, str]) -> None:
    _handle, listen, target = idle_daemon
    sock = _hello(target, "alpha")
    with contextlib.closing(sock):
        started = time.monotonic()
        assert sock.recv(1) == b""  # closed cleanly, nothing owed
        assert 0.5 < time.monotonic() - started < 15
    quiet = threading.Event()

    def nothing() -> Iterator[pb.EvaluateBatchRequest]:
        quiet.wait(20)
        yield from ()

    with grpc.insecure_channel(listen) as channel:
        started = time.monotonic()
        call = pb_grpc.EvaluatorStub(channel).EvaluateStream(
            nothing(), timeout=20, metadata=_auth("alpha")
        )
        assert list(call) == []  # the daemon ended it, status OK
        assert 0.5 < time.monotonic() - started < 15
    quiet.set()


@pytest.mark.parametrize("transport", ["grpc", "data"])
def test_the_engine_client_reopens_an_idle_connection(
    idle_daemon: tuple[Daemon, str, str], transport: str
) -> None:
    _handle, listen, target = idle_daemon
    # A long backoff: a client that treated the idle close as a failure would still be down
    # (failing spans at once) when the next span comes.
    client = EvaluatorClient(
        listen,
        TOKENS["alpha"],
        data_target=target if transport == "data" else None,
        backoff_initial_s=10.0,
    )
    try:
        assert client.wait_connected(10)
        for round_ in range(2):
            future = client.submit("calc", "17 * 23 + 91", 5000)
            client.flush()
            result = future.result(10)
            assert (result.value, result.error_code) == ("482", None), (round_, result)
            time.sleep(2.5)  # the daemon closes the idle connection meanwhile
        assert client.stats.disconnects >= 1
        assert client.stats.unavailable == 0
    finally:
        client.close()


def test_data_max_connections_is_a_hard_cap_with_more_tenants_than_connections(
    tmp_path: Path,
) -> None:
    """40 tenants and ``data_max_connections = 16``: each tenant's minimum share of one once beat
    the cap (40 connections open at once). The cap is what an operator sizes memory by: 16 are
    served, the others refused ``quota_exceeded`` until one closes."""
    tokens = {f"t{index:02d}": f"t{index:02d}-token-0123456789" for index in range(40)}
    config = "\n".join(
        [
            "[server]",
            "threads = 2",
            f'data_listen = "unix:{tmp_path / "data.sock"}"',
            "data_max_connections = 16",
            "shutdown_grace_s = 2",
            *(tenant_table(name, token=token, evaluators=["*"]) for name, token in tokens.items()),
        ]
    )
    handle = start_daemon(tmp_path, config, listen=f"127.0.0.1:{free_port()}")
    target = f"unix:{tmp_path / 'data.sock'}"
    held: list[DataConnection] = []
    refused: list[ErrorCode] = []
    try:
        for token in tokens.values():
            try:
                held.append(DataConnection.connect(target, token))
            except DataCallError as error:
                refused.append(error.code)
        assert len(held) == 16
        assert refused == [ErrorCode.QUOTA_EXCEEDED] * 24
        assert _data_calc(held[0]) == "42"
        held.pop().close()
        with _connect_retrying_token(target, tokens["t39"]) as late:
            assert _data_calc(late) == "42"
    finally:
        for connection in held:
            connection.close()
        assert handle.stop() == 0, Path(handle.log_path).read_text()


def _connect_retrying_token(target: str, token: str) -> DataConnection:
    give_up = time.monotonic() + 10
    while True:
        try:
            return DataConnection.connect(target, token)
        except DataCallError:
            assert time.monotonic() < give_up
            time.sleep(0.05)
