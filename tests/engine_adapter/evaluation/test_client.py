"""The evaluator clients: the evald stream client against the real daemon (``evald serve`` as a
subprocess on a real unix socket), over gRPC and over the data path, including a daemon killed
mid-stream, a hung daemon and a restart; and the in-process WASM and Python-reference
evaluators."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evald"))

from daemon_harness import Daemon, start_daemon

from engine_adapter import (
    EvalResult,
    EvaluatorClient,
    InProcessWasmEvaluator,
    ReferenceEvaluator,
    build_structural_tag,
    list_evaluators,
    standard_evaluators,
)
from evald.daemon import hash_token

TOKEN = "engine-tenant-token-0123456789abcdef"
# Margin for a busy 2-core machine: "within the deadline" is asserted against deadline + slack.
SLACK_S = 2.0

CONFIG = f"""
[server]
threads = 2
shutdown_grace_s = 2

[[tenants]]
name = "local"
evaluators = ["*"]
allow_register = true

[[tenants]]
name = "engine"
token_sha256 = "{hash_token(TOKEN)}"
evaluators = ["calc"]
"""

# (evaluator, content): values come from the reference implementations, never hard-coded.
SPANS = [
    ("calc", "17 * 23 + 91"),
    ("calc", "1 / 0"),
    ("strop", 'count("strawberry", "r")'),
    ("date", "2024-01-31 + 1 month"),
    ("checksum", 'crc32("hello")'),
]


#: The engine client's two transports: the gRPC stream and the data path (docs/data-path.md).
TRANSPORTS = ("grpc", "data")



def stop_process(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP, then wait until the kernel reports every thread of the process stopped (state
    ``T``), so that nothing it was about to do can still happen after this returns."""
    os.kill(pid, signal.SIGSTOP)
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                with open(f"/proc/{pid}/task/{task}/stat", encoding="ascii") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
        if states and all(state == "T" for state in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")

def config(root: Path) -> str:
    """CONFIG with the data path on ``root/data.sock``."""
    return CONFIG.replace("[server]\n", f'[server]\ndata_listen = "unix:{root}/data.sock"\n', 1)


def evaluator_client(
    daemon: Daemon, transport: str, token: str | None = None, **options: Any
) -> EvaluatorClient:
    data_target = f"unix:{daemon.config_path.parent / 'data.sock'}" if transport == "data" else None
    return EvaluatorClient(daemon.target, token, data_target=data_target, **options)


def expected(evaluator: str, content: str) -> tuple[str | None, str | None]:
    from evaluators_wasm.reference import GuestError, reference

    try:
        return reference(evaluator)(content.encode()), None
    except GuestError as exc:
        return None, exc.code


def outcome(result: EvalResult) -> tuple[str | None, str | None]:
    return result.value, result.error_code


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("evald")
    handle = start_daemon(root, config(root))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(params=TRANSPORTS)
def client(daemon: Daemon, request: pytest.FixtureRequest) -> Iterator[EvaluatorClient]:
    with evaluator_client(daemon, request.param) as evaluator:
        assert evaluator.wait_connected(30.0)
        yield evaluator


def test_one_flush_sends_every_span_in_one_message(client: EvaluatorClient) -> None:
    futures = [client.submit(name, content, 5000) for name, content in SPANS]
    assert not any(f.done() for f in futures), "nothing is sent before the flush"
    client.flush()
    results = [f.result(timeout=30) for f in futures]
    assert client.stats.messages_sent == 1
    for (name, content), result in zip(SPANS, results, strict=True):
        assert outcome(result) == expected(name, content), (name, content)
    ok = next(r for r in results if r.value is not None)
    assert ok.fuel_used > 0


def test_unknown_evaluator_is_a_span_error_not_a_broken_stream(client: EvaluatorClient) -> None:
    bad = client.submit("no_such_evaluator", "1", 5000)
    good = client.submit("calc", "2 + 2", 5000)
    client.flush()
    assert bad.result(timeout=30).error_code == "unknown_evaluator"
    assert good.result(timeout=30).value == "4"
    assert client.connected


def test_a_response_as_large_as_the_daemon_sends_is_received(
    daemon: Daemon, client: EvaluatorClient
) -> None:
    """One flush whose values add up to more than a message may carry (12 MB): every span gets
    its value, or its own ``output_too_large`` when the daemon's response budget runs out; the
    connection never breaks (which would give every span ``unavailable``)."""
    from daemon_harness import module

    daemon.client().register(module("output", "big_output", pages=2, out_cap=65_536))
    # The module answers N bytes "x", N read from the input's first four bytes (little-endian):
    # 400 values of 30,840 bytes are 12 MB, more than one message may carry (8 MiB by default).
    size = int.from_bytes(b"xx\0\0", "little")
    try:
        futures = [client.submit("big_output", "xx\0\0", 20_000) for _ in range(400)]
        client.flush()
        results = [future.result(timeout=30) for future in futures]
        codes = {result.error_code for result in results}
        assert codes <= {None, "output_too_large"}, {r.message for r in results}
        values = [result.value for result in results if result.value is not None]
        assert values and all(value == "x" * size for value in values), {len(v) for v in values}
        assert client.connected
    finally:
        daemon.client().delete("big_output")  # the module-scoped daemon serves other tests


def test_list_evaluators_builds_the_same_grammar_as_the_manifests(daemon: Daemon) -> None:
    listed = {spec.name: spec for spec in list_evaluators(daemon.target)}
    source = {spec.name: spec for spec in standard_evaluators()}
    assert set(listed) == set(source)
    for name, spec in source.items():
        assert listed[name].input_grammar == spec.input_grammar
        assert listed[name].result_regex == spec.result_regex
        # The examples travel too, so instructions can be rendered from ListEvaluators.
        assert listed[name].examples == spec.examples and spec.examples
    from_daemon = build_structural_tag(list(listed.values()))
    from_source = build_structural_tag([source[name] for name in listed])
    assert from_daemon.structural_tag == from_source.structural_tag


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bearer_token_selects_the_tenant(daemon: Daemon, transport: str) -> None:
    assert [s.name for s in list_evaluators(daemon.target, TOKEN)] == ["calc"]
    with evaluator_client(daemon, transport, TOKEN) as client:
        assert client.wait_connected(30.0)
        allowed = client.submit("calc", "6 * 7", 5000)
        refused = client.submit("strop", 'len("a")', 5000)
        client.flush()
        assert allowed.result(timeout=30).value == "42"
        assert refused.result(timeout=30).error_code == "permission_denied"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_wrong_token_fails_spans_with_permission_denied(daemon: Daemon, transport: str) -> None:
    with evaluator_client(daemon, transport, "not-a-valid-token-at-all") as client:
        deadline_s = 5.0
        started = time.monotonic()
        future = client.submit("calc", "1 + 1", int(deadline_s * 1000))
        client.flush()
        result = future.result(timeout=deadline_s + SLACK_S)
        assert result.error_code == "permission_denied"
        assert "token" in result.message
        assert time.monotonic() - started < deadline_s + SLACK_S


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_no_daemon_gives_unavailable_within_the_deadline(tmp_path: Path, transport: str) -> None:
    absent = f"unix:{tmp_path / 'absent.sock'}"
    with EvaluatorClient(absent, data_target=absent if transport == "data" else None) as client:
        started = time.monotonic()
        first = client.submit("calc", "1 + 1", 1000)
        client.flush()
        assert first.result(timeout=1 + SLACK_S).error_code == "unavailable"
        second = client.submit("calc", "1 + 1", 1000)
        assert second.result(timeout=SLACK_S).error_code == "unavailable"
        assert time.monotonic() - started < 1 + SLACK_S
        assert "no socket" in second.result().message


def test_tcp_target_without_a_listener_gives_unavailable(tmp_path: Path) -> None:
    from daemon_harness import free_port

    with EvaluatorClient(f"127.0.0.1:{free_port()}", connect_timeout_s=0.3) as client:
        future = client.submit("calc", "1 + 1", 2000)
        client.flush()
        assert future.result(timeout=2 + SLACK_S).error_code == "unavailable"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_hung_daemon_gives_deadline_exceeded_at_the_deadline(
    tmp_path: Path, transport: str
) -> None:
    daemon = start_daemon(tmp_path, config(tmp_path))
    try:
        with evaluator_client(daemon, transport) as client:
            assert client.wait_connected(30.0)
            stop_process(daemon.process.pid)  # a real hang: the process stops
            try:
                started = time.monotonic()
                future = client.submit("calc", "2 + 2", 300)
                client.flush()
                result = future.result(timeout=0.3 + SLACK_S)
                waited = time.monotonic() - started
            finally:
                os.kill(daemon.process.pid, signal.SIGCONT)
            assert result.error_code == "deadline_exceeded"
            assert 0.25 <= waited < 0.3 + SLACK_S
            later = client.submit("calc", "3 + 3", 10_000)
            client.flush()
            assert later.result(timeout=30).value == "6", "the stream survives a late answer"
    finally:
        daemon.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_daemon_that_drains_gives_its_own_code_and_reason(tmp_path: Path, transport: str) -> None:
    """SIGTERM: the daemon ends the connection with its reason (on the data path an ERROR frame,
    ``unavailable``: shutting down). Spans submitted while the client waits to reconnect fail
    with that code and that reason, each in its own field."""
    daemon = start_daemon(tmp_path, config(tmp_path))
    with evaluator_client(daemon, transport, backoff_initial_s=30.0, backoff_max_s=30.0) as client:
        assert client.wait_connected(30.0)
        warm = client.submit("calc", "1 + 1", 10_000)
        client.flush()
        assert warm.result(timeout=30).value == "2"
        assert daemon.stop() == 0
        give_up = time.monotonic() + 30
        while client.connected and time.monotonic() < give_up:
            time.sleep(0.01)
        assert not client.connected
        result = client.submit("calc", "2 + 2", 5000).result(timeout=SLACK_S)
        assert result.error_code == "unavailable", result
        if transport == "data":
            assert "shutting down" in result.message, result


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_daemon_killed_mid_stream_then_restarted(tmp_path: Path, transport: str) -> None:
    daemon = start_daemon(tmp_path, config(tmp_path))
    try:
        with evaluator_client(
            daemon, transport, backoff_initial_s=0.05, backoff_max_s=0.5, connect_timeout_s=0.5
        ) as client:
            assert client.wait_connected(30.0)
            warm = client.submit("calc", "1 + 1", 10_000)
            client.flush()
            assert warm.result(timeout=30).value == "2"
            stop_process(daemon.process.pid)  # hold the span in flight…
            deadline_ms = 5000
            started = time.monotonic()
            in_flight = client.submit("calc", "2 + 2", deadline_ms)
            client.flush()
            time.sleep(0.2)
            daemon.kill()  # …then kill -9: the stream breaks with the span unanswered
            result = in_flight.result(timeout=deadline_ms / 1000 + SLACK_S)
            assert result.error_code == "unavailable"
            assert time.monotonic() - started < deadline_ms / 1000, "failed fast, not at deadline"
            assert not client.connected
            while_down = client.submit("calc", "3 + 3", deadline_ms)
            assert while_down.result(timeout=SLACK_S).error_code == "unavailable"
            assert client.stats.disconnects >= 1

            restarted = start_daemon(
                tmp_path,
                config(tmp_path),
                socket_path=daemon.socket_path,
                state_dir=daemon.state_dir,
            )
            try:
                assert client.wait_connected(30.0), "the client reconnects by itself"
                again = client.submit("calc", "4 + 4", 10_000)
                client.flush()
                assert again.result(timeout=30).value == "8"
                assert client.stats.connects >= 2
            finally:
                restarted.stop()
    finally:
        if daemon.alive():
            daemon.kill()


def test_closed_client_answers_unavailable(daemon: Daemon) -> None:
    client = EvaluatorClient(daemon.target)
    client.close()
    client.close()  # idempotent
    assert client.submit("calc", "1", 1000).result(timeout=1).error_code == "unavailable"


def test_injector_with_the_daemon_forces_the_evaluated_value(client: EvaluatorClient) -> None:
    xgr = pytest.importorskip("xgrammar")
    from engine_adapter import Injector, TokenCodec, special_token_texts
    from engine_adapter.local import load_tokenizer

    tokenizer = load_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    grammar = build_structural_tag(
        list_evaluators(client.target), special_tokens=special_token_texts(tokenizer)
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(grammar.json()))
    injector = Injector(TokenCodec.shared(tokenizer), grammar.bindings, client, deadline_ms=10_000)
    for token in tokenizer.encode("A box: <calc>17 * 23 + 91</calc>", add_special_tokens=False):
        assert matcher.accept_token(token)
        injector.accept_token(token)
    while injector.pending:
        forced = injector.forced_tokens()
        if not forced:
            injector.wait()
        for token in forced:
            assert matcher.accept_token(token)
            injector.accept_token(token)
    value, _ = expected("calc", "17 * 23 + 91")
    assert injector.text.endswith(f"</calc><result>{value}</result>")
    assert injector.spans[0].value == value


def agree(evaluator: Any) -> None:
    futures = [evaluator.submit(name, content, 5000) for name, content in SPANS]
    evaluator.flush()
    for (name, content), future in zip(SPANS, futures, strict=True):
        assert outcome(future.result(timeout=30)) == expected(name, content), (name, content)
    unknown = evaluator.submit("no_such_evaluator", "1", 1000)
    assert unknown.result(timeout=30).error_code == "unknown_evaluator"


def test_in_process_wasm_evaluator_agrees_with_the_references() -> None:
    with InProcessWasmEvaluator(threads=2) as evaluator:
        assert {"calc", "strop"} <= set(evaluator.names)
        agree(evaluator)
    closed = evaluator.submit("calc", "1", 1000)
    assert closed.result(timeout=1).error_code == "unavailable"


def test_reference_evaluator_and_its_deadline() -> None:
    with ReferenceEvaluator(threads=1) as evaluator:
        agree(evaluator)
        # A long sum of fractions keeps the only worker busy (a reference call cannot be
        # interrupted); spans queued behind it are answered at their deadline, not after it.
        # 40,000 terms (760 KB) take ~170 ms on a fast CPU: well past the queued 50 ms.
        slow = " + ".join(["123456789012 / 7"] * 40_000)
        busy = evaluator.submit("calc", slow, 60_000)
        started = time.monotonic()
        queued = evaluator.submit("calc", "1 + 1", 50)
        assert queued.result(timeout=SLACK_S).error_code == "deadline_exceeded"
        assert time.monotonic() - started < SLACK_S
        assert outcome(busy.result(timeout=60)) == expected("calc", slow)
