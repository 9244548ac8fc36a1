"""A fleet for tests: a real PostgreSQL (one per test session), a fresh store database per test,
and real daemons that follow it.

The server comes from :func:`evald.testing.start_postgres` (the machine's PostgreSQL binaries,
``initdb`` in a temporary folder as a non-root user). Each :class:`Fleet` has its own database,
set up by ``evald store init`` as the cluster's owner would; the daemons log in as ``pod`` (a
member of ``evald_daemon``) and the operator as ``ops`` (``evald_operator``), each with a
password from a file, as deployed.
"""

from __future__ import annotations

import itertools
import os
import queue
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from daemon_harness import EVALD, Daemon, free_port, start_daemon, tenant_block

from evald.client import CallError, Client
from evald.contract import pb, pb_grpc
from evald.daemon import StoreSettings, hash_token, init_store, store_database
from evald.testing import PostgresServer

__all__ = [
    "DAEMON_LOGIN",
    "OPERATOR_LOGIN",
    "Fleet",
    "at_revision",
    "client",
    "head",
    "logins",
    "one_item",
    "open_stream",
    "until",
]

DAEMON_LOGIN = "pod"
OPERATOR_LOGIN = "ops"
_numbers = itertools.count()


def logins(server: PostgresServer) -> None:
    """The session's two login roles (roles are the cluster's, not one database's)."""
    bootstrap = f"fleet_bootstrap_{os.getpid()}"
    server.create_database(bootstrap)
    init_store(server.store_settings(database=bootstrap))
    server.create_login(DAEMON_LOGIN, "evald_daemon")
    server.create_login(OPERATOR_LOGIN, "evald_operator")


@dataclass
class Fleet:
    """One test's store database and the daemons that follow it."""

    server: PostgresServer
    root: Path
    name: str = field(default_factory=lambda: f"fleet_{os.getpid()}_{next(_numbers)}")
    daemons: list[Daemon] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.server.create_database(self.name)
        init_store(self.settings("evald_admin"))
        self.operator = store_database(self.settings(OPERATOR_LOGIN), application="tests")

    def url(self, user: str = DAEMON_LOGIN) -> str:
        return self.server.url(user, self.name)

    def settings(self, user: str = DAEMON_LOGIN) -> StoreSettings:
        """The harness's settings for ``user`` (a busy machine's connect timeout)."""
        return self.server.store_settings(user, self.name)

    def config(self, *local_tenants: str, poll_s: float = 5.0, extra: Sequence[str] = ()) -> str:
        """A daemon config following this fleet's store (``local_tenants``: its own tables)."""
        return "\n".join(
            [
                "[server]",
                "threads = 2",
                "shutdown_grace_s = 2",
                *extra,
                "[store]",
                f'url = "{self.url()}"',
                f'password_file = "{self.server.password_file(DAEMON_LOGIN)}"',
                f"poll_s = {poll_s}",
                "connect_timeout_s = 5",  # a busy machine forks backends slowly
                *local_tenants,
            ]
        )

    def start(self, count: int = 1, *, config: str | None = None, **options: Any) -> list[Daemon]:
        """``count`` daemons on this store, each with its own state folder and socket."""
        started = []
        for _ in range(count):
            index = len(self.daemons)
            root = self.root / f"daemon{index}"
            text = (config or self.config()).replace("{root}", str(root))
            if "{metrics_port}" in text:
                port = free_port()
                text = text.replace("{metrics_port}", str(port))
                options["metrics_port"] = port
            daemon = start_daemon(root, text, state_dir=root / "state", **options)
            self.daemons.append(daemon)
            started.append(daemon)
        return started

    def restart(self, daemon: Daemon, *, config: str | None = None) -> Daemon:
        """Starts ``daemon`` again (stopped or killed) on its state folder and socket."""
        root = daemon.config_path.parent
        fresh = start_daemon(
            root,
            config or daemon.config_path.read_text(),
            state_dir=daemon.state_dir,
            socket_path=daemon.socket_path,
            metrics_port=daemon.metrics_port,
        )
        self.daemons[self.daemons.index(daemon)] = fresh
        return fresh

    def add_tenant(
        self,
        name: str,
        *,
        may_register: bool = True,
        evaluators: Sequence[str] = ("*",),
        limits: dict[str, Any] | None = None,
        max_modules: int = 16,
    ) -> str:
        """Adds a tenant through the operator's role; returns its token."""
        token = f"{name}-fleet-token-{os.urandom(8).hex()}"
        self.operator.add_tenant(
            "tests",
            name,
            [hash_token(token)],
            limits=limits or {},
            evaluators=list(evaluators),
            may_register=may_register,
            max_modules=max_modules,
        )
        return token

    def cli(self, *args: str, user: str = OPERATOR_LOGIN) -> subprocess.CompletedProcess[str]:
        """``evald ARGS --store URL --password-file FILE`` as ``user`` (the operator)."""
        command, *rest = args
        verb = [rest.pop(0)] if command in ("tenants", "store") and rest else []
        return subprocess.run(
            [
                EVALD,
                command,
                *verb,
                *rest,
                "--store",
                self.url(user),
                "--password-file",
                str(self.server.password_file(user)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    def close(self) -> None:
        for daemon in self.daemons:
            if daemon.alive():
                daemon.stop()
        self.operator.close()
        if self.server.running():
            from psycopg import sql

            self.server.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name))
            )


WAIT_S = 30.0


def until(check: Callable[[], bool], what: str) -> None:
    """Waits until ``check()`` holds (bounded: a test that never converges fails)."""
    give_up = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > give_up:
            raise AssertionError(f"never: {what}")
        time.sleep(0.02)


def client(daemon: Daemon, token: str | None) -> Client:
    handle = Client(daemon.target, token, timeout_s=10.0)
    daemon.clients.append(handle)
    return handle


def at_revision(daemons: list[Daemon], token: str, revision: int) -> None:
    """Every daemon has applied ``revision``."""
    for daemon in daemons:
        probe = client(daemon, token)

        def applied(probe: Client = probe) -> bool:
            try:
                return probe.revision() >= revision
            except CallError:
                return False

        until(applied, f"{daemon.target} at revision {revision}")


def head(fleet: Fleet) -> int:
    return fleet.operator.head()


def open_stream(
    daemon: Daemon, token: str, timeout_s: float = 60
) -> tuple[queue.Queue[pb.EvaluateBatchRequest | None], Iterator[pb.EvaluateBatchResponse]]:
    """A gRPC ``EvaluateStream`` on ``token``: the queue sends (``None`` ends the stream), the
    iterator receives."""
    channel = grpc.insecure_channel(daemon.target)
    stub = pb_grpc.EvaluatorStub(channel)
    outgoing: queue.Queue[pb.EvaluateBatchRequest | None] = queue.Queue()

    def requests() -> Iterator[pb.EvaluateBatchRequest]:
        while (message := outgoing.get()) is not None:
            yield message

    responses = stub.EvaluateStream(
        requests(), metadata=(("authorization", f"Bearer {token}"),), timeout=timeout_s
    )
    return outgoing, responses


def one_item(evaluator: str, data: bytes, request_id: str) -> pb.EvaluateBatchRequest:
    return pb.EvaluateBatchRequest(
        items=[pb.EvaluateRequest(evaluator=evaluator, input=data, id=request_id)]
    )


def local_tenant(name: str, **settings: Any) -> str:
    """A config tenant of the test config (``daemon_harness.TOKENS``)."""
    return tenant_block(name, **settings)
