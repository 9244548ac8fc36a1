"""What a caller can make the daemon hold, against a real daemon over loopback TCP.

1. Before authentication: a call without a valid token is refused from its metadata; its body is
   never read, so large unauthenticated messages cost the daemon nothing.
2. Streams that never read: unread output is bounded in bytes per stream and per tenant (the
   ``strop`` ``replace`` amplification turns 6 KB of input into a 60 KB value), and a stream
   whose client reads nothing is ended with ``quota_exceeded``.
3. Oversized batch responses: every item gets its value or its own ``output_too_large``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from daemon_harness import TOKENS, Daemon, free_port, outcome, start_daemon, tenant_block

from evald.contract import ERROR_CODE_METADATA_KEY, pb, pb_grpc

MIB = 2**20
#: 6,000 characters of input, a 60,002-byte value.
_AMPLIFY = b'replace("' + b"a" * 6000 + b'", "a", "aaaaaaaaaa")'
_STREAM_UNREAD = 2 * MIB
_TENANT_UNREAD = 4 * MIB


def _config() -> str:
    return "\n".join(
        [
            "[server]",
            "threads = 2",
            "max_batch_items = 4096",
            f"stream_unread_bytes = {_STREAM_UNREAD}",
            "stream_stall_s = 1.0",
            "shutdown_grace_s = 2",
            tenant_block("alpha", evaluators=["*"], limits={"max_concurrency": 20000}),
            tenant_block(
                "beta",
                evaluators=["*"],
                limits={"max_concurrency": 20000, "unread_bytes": _TENANT_UNREAD},
            ),
        ]
    )


@pytest.fixture(scope="module")
def tcp_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str]]:
    listen = f"127.0.0.1:{free_port()}"
    handle = start_daemon(tmp_path_factory.mktemp("tcp"), _config(), listen=listen)
    try:
        yield handle, listen
    finally:
        assert handle.stop() == 0, Path(handle.log_path).read_text()


def _channel(listen: str, *, small_window: bool = False) -> grpc.Channel:
    """A client channel; ``small_window`` keeps HTTP/2's 64 KiB receive window (no bandwidth
    probing), so a client that does not read really stops taking bytes from the daemon."""
    limit = 64 * MIB
    options = [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
    ]
    if small_window:
        options.append(("grpc.http2.bdp_probe", 0))
    return grpc.insecure_channel(listen, options=options)


def _auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def _code(error: grpc.RpcError) -> str | None:
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == ERROR_CODE_METADATA_KEY:
            return str(value)
    return None


def _rss(daemon: Daemon) -> int:
    rss = daemon.rss_bytes()
    assert rss is not None, "the daemon died"
    return rss


def _calc_ok(listen: str) -> None:
    with _channel(listen) as channel:
        stub = pb_grpc.EvaluatorStub(channel)
        response = stub.Evaluate(
            pb.EvaluateRequest(evaluator="calc", input=b"17 * 23 + 91"),
            timeout=30,
            metadata=_auth("alpha"),
        )
    assert response.value == "482"


def test_unauthenticated_messages_are_refused_unread(tcp_daemon: tuple[Daemon, str]) -> None:
    daemon, listen = tcp_daemon
    _calc_ok(listen)
    # 4,000 items of 2 KB: a valid 8 MB EvaluateBatch, just under the receive limit.
    payload = pb.EvaluateBatchRequest(
        items=[pb.EvaluateRequest(evaluator="calc", input=b"1" * 2000) for _ in range(4000)]
    ).SerializeToString()
    assert 7 * MIB < len(payload) < 8 * MIB
    before = _rss(daemon)
    peak = before
    failures: list[str] = []
    credentials = ((), (("authorization", "Bearer not-a-token"),), (("authorization", "Basic x"),))

    def attack(index: int) -> None:
        with _channel(listen) as channel:
            call = channel.unary_unary("/evald.v1.Evaluator/EvaluateBatch")
            for attempt in range(6):
                metadata = credentials[(index + attempt) % len(credentials)]
                try:
                    call(payload, timeout=30, metadata=metadata)
                    failures.append("an unauthenticated batch was served")
                except grpc.RpcError as error:
                    if _code(error) != "permission_denied":
                        failures.append(f"{error.code()}: {_code(error)} {error.details()}")  # type: ignore[attr-defined]

    threads = [threading.Thread(target=attack, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        peak = max(peak, _rss(daemon))
        time.sleep(0.02)
    for thread in threads:
        thread.join()
    assert failures == []
    # 24 messages of 8 MB were sent; none was parsed or held (parsing one holds more than 8 MB).
    assert peak - before < 48 * MIB, (before, peak)
    print("unauthenticated attack: daemon RSS", before // MIB, "->", peak // MIB, "MiB")
    _calc_ok(listen)


def _amplifying_requests(batches: int) -> Iterator[pb.EvaluateBatchRequest]:
    for batch in range(batches):
        yield pb.EvaluateBatchRequest(
            items=[
                pb.EvaluateRequest(id=f"{batch}.{i}", evaluator="strop", input=_AMPLIFY)
                for i in range(100)
            ]
        )


def test_streams_that_never_read_hold_bounded_output(tcp_daemon: tuple[Daemon, str]) -> None:
    daemon, listen = tcp_daemon
    before = _rss(daemon)
    channels = [_channel(listen, small_window=True) for _ in range(3)]
    try:
        # 3 x 3,000 items of 60 KB of output: 540 MB if the daemon held them all.
        streams = [
            pb_grpc.EvaluatorStub(channel).EvaluateStream(
                _amplifying_requests(30), timeout=60, metadata=_auth("beta")
            )
            for channel in channels
        ]
        peak = before
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            peak = max(peak, _rss(daemon))
            time.sleep(0.05)
        # The tenant's bound (4 MiB) over all three streams, plus gRPC's own buffers.
        assert peak - before < 64 * MIB, (before, peak)
        print("non-reading streams: daemon RSS", before // MIB, "->", peak // MIB, "MiB")
        _calc_ok(listen)  # another tenant is served meanwhile
        for stream in streams:
            stream.cancel()
    finally:
        for channel in channels:
            channel.close()


def test_a_stream_whose_client_reads_nothing_is_cut_off(tcp_daemon: tuple[Daemon, str]) -> None:
    daemon, listen = tcp_daemon
    before = sum(1 for line in daemon.log_lines() if line.get("msg", "").startswith("stream cut"))
    with _channel(listen, small_window=True) as channel:
        stream = pb_grpc.EvaluatorStub(channel).EvaluateStream(
            _amplifying_requests(30), timeout=15, metadata=_auth("alpha")
        )
        time.sleep(4.0)  # well past stream_stall_s (1 s) without reading
        received = 0
        with pytest.raises(grpc.RpcError) as ended:
            for message in stream:
                received += len(message.results)
    assert received < 3000
    cut = [line for line in daemon.log_lines() if line.get("msg", "").startswith("stream cut")]
    assert len(cut) > before and cut[-1]["tenant"] == "alpha"
    # The status is quota_exceeded. gRPC sends it after any message it has begun to send, and
    # when the stall caught one half-way the client sees its own deadline instead (the daemon
    # has ended the stream and taken its budget back either way).
    if _code(ended.value) != "quota_exceeded":
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ended.value  # type: ignore[attr-defined]
    else:
        assert "read no results" in ended.value.details()  # type: ignore[attr-defined]
    _calc_ok(listen)
    # alpha's budget is whole again: a stream that reads gets everything
    with _channel(listen) as channel:
        stub = pb_grpc.EvaluatorStub(channel)
        count = sum(
            len(message.results)
            for message in stub.EvaluateStream(
                _amplifying_requests(2), timeout=60, metadata=_auth("alpha")
            )
        )
    assert count == 200


def test_a_stream_that_reads_gets_every_result(tcp_daemon: tuple[Daemon, str]) -> None:
    _daemon, listen = tcp_daemon

    with _channel(listen) as channel:
        stub = pb_grpc.EvaluatorStub(channel)
        ids = set()
        stream = stub.EvaluateStream(_amplifying_requests(4), timeout=120, metadata=_auth("beta"))
        for message in stream:
            for result in message.results:
                assert outcome(result) == "ok", result.error
                assert len(result.value) == 60002
                ids.add(result.id)
    # The same tenant, after its stalled streams ended: its unread budget came back whole.
    assert len(ids) == 400


def test_an_oversized_batch_response_answers_every_item(tcp_daemon: tuple[Daemon, str]) -> None:
    _daemon, listen = tcp_daemon
    items = [pb.EvaluateRequest(id=str(i), evaluator="strop", input=_AMPLIFY) for i in range(160)]
    with _channel(listen) as channel:
        stub = pb_grpc.EvaluatorStub(channel)
        response = stub.EvaluateBatch(
            pb.EvaluateBatchRequest(items=items), timeout=120, metadata=_auth("alpha")
        )
    assert [result.id for result in response.results] == [str(i) for i in range(160)]
    outcomes = [outcome(result) for result in response.results]
    values = outcomes.count("ok")
    # 8 MiB of values fit (139 of 60 KB); every other item has its own typed error.
    assert 100 < values < 160
    assert outcomes.count("output_too_large") == 160 - values
    dropped = next(r for r in response.results if outcome(r) == "output_too_large")
    assert "max_message_bytes" in dropped.error.message
    assert response.ByteSize() < 2 * 8 * MIB + 4096 * 1536


def test_reflection_needs_a_token_and_health_does_not(tcp_daemon: tuple[Daemon, str]) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    _daemon, listen = tcp_daemon
    with _channel(listen) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.ServerReflectionInfo(iter([request]), timeout=10))
        assert _code(refused.value) == "permission_denied"
        replies = list(
            stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=_auth("alpha"))
        )
        names = {s.name for s in replies[0].list_services_response.service}
        assert "evald.v1.Evaluator" in names
