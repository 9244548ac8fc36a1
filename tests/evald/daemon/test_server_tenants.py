"""Tenants: authentication, isolation of modules and standard evaluators, quotas, TCP and TLS."""

from __future__ import annotations

import concurrent.futures
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from daemon_harness import TOKENS, Daemon, free_port, module, outcome, start_daemon, tenant_block

from evald.client import CallError, Client
from evald.contract import ERROR_CODE_METADATA_KEY, pb, pb_grpc
from evald.testing import arg


def call_error(function: object, *args: object) -> CallError:
    assert callable(function)
    with pytest.raises(CallError) as info:
        function(*args)
    return info.value


def test_a_wrong_token_is_refused(daemon: Daemon) -> None:
    client = Client(daemon.target, "not-a-token")
    try:
        for call in (client.list_evaluators, lambda: client.evaluate("calc", "1 + 1")):
            error = call_error(call)
            assert error.code is not None and error.code.value == "permission_denied"
            assert "matches no tenant" in error.message
    finally:
        client.close()


def test_malformed_authorization_is_refused_with_status_and_metadata(daemon: Daemon) -> None:
    with grpc.insecure_channel(daemon.target) as channel:
        stub = pb_grpc.EvaluatorStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ListEvaluators(
                pb.ListEvaluatorsRequest(), metadata=(("authorization", "Basic abc"),), timeout=10
            )
    error = info.value
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (ERROR_CODE_METADATA_KEY, "permission_denied") in tuple(error.trailing_metadata())
    assert "Bearer TOKEN" in error.details()


def test_list_evaluators_names_the_callers_own_tenant(daemon: Daemon) -> None:
    """``ListEvaluatorsResponse.tenant`` is the tenant the call's own token authenticates: many
    tenants' calls interleaved on one channel each get their own name, never another's, and
    the token-less call over the unix socket is the local tenant."""
    callers: list[tuple[str, tuple[tuple[str, str], ...]]] = [("local", ())]
    callers += [(name, (("authorization", f"Bearer {TOKENS[name]}"),)) for name in TOKENS]
    with grpc.insecure_channel(daemon.target) as channel:
        stub = pb_grpc.EvaluatorStub(channel)

        def named(caller: tuple[str, tuple[tuple[str, str], ...]]) -> tuple[str, str]:
            response = stub.ListEvaluators(
                pb.ListEvaluatorsRequest(), metadata=caller[1], timeout=30
            )
            return caller[0], response.tenant

        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(pool.map(named, callers * 10))
    assert len(answers) == 10 * (1 + len(TOKENS))
    assert all(tenant == expected for expected, tenant in answers), answers


def test_a_tenant_never_sees_calls_or_deletes_another_tenants_module(daemon: Daemon) -> None:
    alpha, beta = daemon.client("alpha"), daemon.client("beta")
    alpha.register(module("echo", "private_a"))
    assert "private_a" not in {info.name for info in beta.list_evaluators()}
    refused = beta.evaluate("private_a", b"steal")
    assert outcome(refused) == "unknown_evaluator"
    assert "alpha" not in refused.error.message  # nothing about the owner leaks
    error = call_error(beta.delete, "private_a")
    assert error.code is not None and error.code.value == "unknown_evaluator"
    assert alpha.evaluate("private_a", b"mine").value == "mine"


def test_the_same_name_in_two_tenants_is_two_evaluators(daemon: Daemon) -> None:
    alpha, beta = daemon.client("alpha"), daemon.client("beta")
    alpha.register(module("echo", "same_name"))
    beta.register(module("output", "same_name"))
    assert alpha.evaluate("same_name", arg(2)).value == arg(2).decode()
    assert beta.evaluate("same_name", arg(2)).value == "xx"


def test_shared_bytes_outlive_one_tenants_delete(daemon: Daemon) -> None:
    alpha, beta = daemon.client("alpha"), daemon.client("beta")
    wasm = module("echo", "dup")
    a = alpha.register(wasm)
    b = beta.register(wasm)
    assert a.sha256 == b.sha256
    beta.delete("dup")
    assert (daemon.state_dir / "modules" / f"{a.sha256}.wasm").exists()
    assert alpha.evaluate("dup", b"still").value == "still"


def test_standard_evaluators_follow_the_tenants_allow_list(daemon: Daemon) -> None:
    viewer = daemon.client("viewer")  # evaluators = ["calc"]
    standard = {info.name for info in viewer.list_evaluators() if info.owner == "standard"}
    assert standard <= {"calc"}
    for name in ("date", "strop", "checksum", "units"):  # installed or not
        response = viewer.evaluate(name, b"x")
        assert outcome(response) == "permission_denied"
        assert "evaluators" in response.error.message


def test_concurrency_quota(daemon: Daemon) -> None:
    narrow = daemon.client("narrow")  # max_concurrency = 2
    narrow.register(module("echo", "quota_echo"))
    results = narrow.evaluate_batch(
        [("quota_echo", b"a"), ("quota_echo", b"b"), ("quota_echo", b"c")]
    )
    assert [outcome(r) for r in results] == ["ok", "ok", "quota_exceeded"]
    assert "max_concurrency" in results[2].error.message
    again = narrow.evaluate_batch([("quota_echo", b"d"), ("quota_echo", b"e")])
    assert [r.value for r in again] == ["d", "e"]  # released after the first batch


def test_rate_quota(daemon: Daemon) -> None:
    metered = daemon.client("metered")  # 0.01/s, burst 3
    metered.register(module("echo", "rate_echo"))
    results = metered.evaluate_batch([("rate_echo", str(i)) for i in range(5)])
    assert [outcome(r) for r in results] == ["ok"] * 3 + ["quota_exceeded"] * 2
    assert "rate" in results[3].error.message
    assert outcome(metered.evaluate("rate_echo", b"later")) == "quota_exceeded"
    # Other tenants are unaffected.
    beta = daemon.client("beta")
    beta.register(module("echo", "rate_other"))
    assert [r.value for r in beta.evaluate_batch([("rate_other", "z")] * 5)] == ["z"] * 5


TCP_CONFIG = (
    "[server]\nthreads = 1\n"
    + tenant_block("local", token=False, evaluators=["*"])
    + tenant_block("alpha", evaluators=["*"])
)


@pytest.fixture(scope="module")
def tcp_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str]]:
    listen = f"127.0.0.1:{free_port()}"
    handle = start_daemon(tmp_path_factory.mktemp("tcp"), TCP_CONFIG, listen=listen)
    try:
        yield handle, listen
    finally:
        assert handle.stop() == 0


def test_tcp_always_requires_a_token(tcp_daemon: tuple[Daemon, str]) -> None:
    _handle, listen = tcp_daemon
    with Client(listen) as anonymous:
        error = call_error(anonymous.list_evaluators)
        assert error.code is not None and error.code.value == "permission_denied"
        assert "no token" in error.message
    with Client(listen, TOKENS["alpha"]) as alpha:
        assert alpha.list_evaluators()  # the standard set


def test_tcp_on_a_public_address_needs_tls(tmp_path: Path) -> None:
    handle = start_daemon(tmp_path, TCP_CONFIG, listen=f"0.0.0.0:{free_port()}", wait=False)
    status = handle.process.wait(timeout=60)
    assert status == 1
    assert "without TLS" in handle.log_path.read_text()


def test_tls(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    config = TCP_CONFIG.replace(
        "[server]\n", f'[server]\ntls_cert = "{cert}"\ntls_key = "{key}"\n', 1
    )
    listen = f"127.0.0.1:{free_port()}"
    handle = start_daemon(tmp_path / "d", config, listen=listen, tls_ca=cert)
    try:
        with Client(listen, TOKENS["alpha"], tls_ca=cert) as alpha:
            assert alpha.list_evaluators()
        with Client(listen, TOKENS["alpha"], timeout_s=3) as plaintext:
            error = call_error(plaintext.list_evaluators)
            assert error.unreachable
    finally:
        assert handle.stop() == 0
