"""Nothing survives a call: the ``remember`` module answers what an earlier call left in its
global and its heap. Under ``isolation = "fresh"`` (the default) it finds nothing, on every path
(unary, batch, gRPC stream, data path), on both workers, within one tenant and across tenants.
The same load under ``reuse`` is the control: there it finds the tenant's own earlier inputs
(never another tenant's), and it shows that the load reached both workers."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import TOKENS, Daemon, start_daemon, tenant_block

from evald.client import DataConnection
from evald.contract import pb
from evald.testing import REMEMBERED_NOTHING, named_guest

PATHS = ("unary", "batch", "stream", "data")
TENANTS = ("alpha", "beta")
_counter = itertools.count()
#: Every input each tenant has sent, in this module's daemons.
SENT: dict[str, set[bytes]] = {tenant: set() for tenant in TENANTS}


@pytest.fixture(scope="module", params=["fresh", "reuse"])
def daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    mode = request.param
    root = tmp_path_factory.mktemp(f"isolation-{mode}")
    config = "\n".join(
        [
            "[server]",
            "threads = 2",
            f'data_listen = "unix:{root}/data.sock"',
            "[host]",
            f'isolation = "{mode}"',
            *(
                tenant_block(name, allow_register=True, evaluators=["*"], limits={"max_running": 2})
                for name in TENANTS
            ),
        ]
    )
    handle = start_daemon(root, config)
    handle.mode = mode  # type: ignore[attr-defined]
    try:
        for tenant in TENANTS:
            handle.client(tenant).register(named_guest("remember", "remember"))
        yield handle
    finally:
        assert handle.stop() == 0, handle.log_path.read_text()


def _inputs(tenant: str, count: int) -> list[bytes]:
    made = [f"{tenant[0]}{next(_counter):05d}".encode() for _ in range(count)]
    SENT[tenant].update(made)
    return made


def _send(daemon: Daemon, tenant: str, path: str, inputs: list[bytes]) -> list[str]:
    """The answers to ``inputs`` sent by ``tenant`` on ``path`` (one message for batch, stream and
    data path)."""
    requests = [
        pb.EvaluateRequest(evaluator="remember", input=x, id=str(i)) for i, x in enumerate(inputs)
    ]
    if path == "unary":
        client = daemon.client(tenant)
        responses = [client.evaluate("remember", x) for x in inputs]
    elif path == "batch":
        responses = daemon.client(tenant).evaluate_batch([("remember", x) for x in inputs])
    elif path == "stream":
        responses = daemon.client(tenant).evaluate_stream([requests])
    else:
        target = f"unix:{Path(daemon.config_path).parent / 'data.sock'}"
        connection = DataConnection.connect(target, TOKENS[tenant])
        try:
            connection.send(pb.EvaluateBatchRequest(items=requests))
            responses = []
            while len(responses) < len(requests):
                message = connection.receive()
                assert message is not None
                responses.extend(message.results)
        finally:
            connection.close()
    assert all(r.WhichOneof("outcome") == "value" for r in responses), responses[:3]
    return [r.value for r in responses]


def _found(answer: str) -> bytes:
    """The previous input an answer reports (b"" for nothing)."""
    assert answer.startswith("G") and answer[5] == "H", answer
    return answer[6:].encode()


@pytest.mark.parametrize("path", PATHS)
def test_a_call_finds_only_what_its_isolation_allows(daemon: Daemon, path: str) -> None:
    mode = daemon.mode  # type: ignore[attr-defined]
    answers: dict[str, list[str]] = {tenant: [] for tenant in TENANTS}
    for _ in range(3):
        for tenant in TENANTS:  # the tenants take turns on the same module
            batch = _inputs(tenant, 1 if path == "unary" else 32)
            answers[tenant] += _send(daemon, tenant, path, batch)
    for tenant in TENANTS:
        if mode == "fresh":
            assert set(answers[tenant]) == {REMEMBERED_NOTHING}, (tenant, answers[tenant][:4])
        else:
            found = [_found(answer) for answer in answers[tenant]]
            # reuse: only this tenant's own earlier inputs, and some are found
            assert all(x == b"" or x in SENT[tenant] for x in found), (tenant, found[:4])
            assert any(found), tenant


def test_the_load_reaches_both_workers(daemon: Daemon) -> None:
    """Under reuse each worker's instance answers nothing once, then what it was sent last: two
    answers of nothing for one tenant on a fresh module prove two instances, one per worker.
    Under fresh every answer is nothing, on whichever worker it ran."""
    mode = daemon.mode  # type: ignore[attr-defined]
    name = f"remember_{mode}"
    client = daemon.client("alpha")
    client.register(named_guest("remember", name))
    nothing = 0
    answers: list[str] = []
    for _ in range(40 if mode == "reuse" else 8):  # until both workers ran one (or give up)
        batch = _inputs("alpha", 64)
        answers += [r.value for r in client.evaluate_batch([(name, x) for x in batch])]
        nothing = answers.count(REMEMBERED_NOTHING)
        if mode == "reuse" and nothing >= 2:
            break
    if mode == "reuse":
        assert nothing == 2, nothing  # two workers, one instance each
    else:
        assert nothing == len(answers) >= 64
