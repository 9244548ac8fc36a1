"""Runs the real daemon (``evald serve``) as a subprocess on a real unix socket, for tests.

The process handling is the product's :mod:`evald.testing` (``evald fuzz`` uses it too); this
file adds what only the tests need: the session config with one tenant per concern, their tokens, a
handle that makes clients for them and runs the CLI, and small helpers for modules and outcomes.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evald import testing as harness
from evald.client import Client
from evald.testing import (
    EVALD,
    START_TIMEOUT_S,
    DaemonProcess,
    free_port,
    named_guest,
    padded,
    tenant_table,
)
from evaluators_wasm import wasm_path

__all__ = [
    "EVALD",
    "START_TIMEOUT_S",
    "TOKENS",
    "Daemon",
    "free_port",
    "module",
    "outcome",
    "padded",
    "session_config",
    "start_daemon",
    "tenant_block",
    "wait_serving",
]

#: Tokens of the test config's tenants (the config holds only their hashes).
TOKENS = {
    name: f"{name}-token-0123456789"
    for name in ("limits", "nofuel", "alpha", "beta", "narrow", "metered", "viewer", "cramped")
}


def tenant_block(name: str, *, token: bool = True, **settings: Any) -> str:
    """One ``[[tenants]]`` table of the test config, with the tenant's token from ``TOKENS``."""
    return tenant_table(name, token=TOKENS[name] if token else None, **settings)


def session_config(metrics_port: int) -> str:
    """The shared daemon's config: one tenant per concern, so tests do not disturb each other."""
    return "\n".join(
        [
            "[server]",
            "threads = 2",
            f'metrics_listen = "127.0.0.1:{metrics_port}"',
            "max_batch_items = 100",
            "shutdown_grace_s = 5",
            "[host]",
            'module_bytes = "256KiB"',
            tenant_block(
                "local", token=False, evaluators=["*"], allow_register=True, max_modules=64
            ),
            tenant_block(
                "limits",
                allow_register=True,
                max_modules=64,
                limits={
                    "fuel": 2_000_000,
                    "memory_bytes": "1MiB",
                    "deadline_ms": 50,
                    "input_bytes": 1000,
                    "output_bytes": 500,
                },
            ),
            tenant_block("nofuel", allow_register=True, limits={"fuel": 0, "deadline_ms": 50}),
            tenant_block("alpha", evaluators=["calc"], allow_register=True, max_modules=64),
            # Both workers (above the default max_running of threads - 1), so one slow item
            # of beta's holds back only the worker it runs on. Fuel enough for far more than
            # the 100 ms deadline on any CPU: a looping item ends at its deadline.
            tenant_block(
                "beta",
                evaluators=["*"],
                allow_register=True,
                max_modules=64,
                limits={"max_running": 2, "fuel": 100_000_000_000},
            ),
            tenant_block("narrow", allow_register=True, limits={"max_concurrency": 2}),
            tenant_block("metered", allow_register=True, limits={"rate_per_s": 0.01, "burst": 3}),
            tenant_block("viewer", evaluators=["calc"]),
            tenant_block("cramped", allow_register=True, max_modules=1),
        ]
    )


@dataclass
class Daemon(DaemonProcess):
    """A running ``evald serve`` subprocess, with clients for the test config's tenants."""

    clients: list[Client] = field(default_factory=list)

    def client(self, tenant: str | None = None, **options: Any) -> Client:
        """A client for ``tenant`` (None: the tokenless local tenant)."""
        token = TOKENS[tenant] if tenant else None
        client = Client(self.target, token, **options)
        self.clients.append(client)
        return client

    def cli(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``evald ARGS`` against this daemon (``--target`` is added after the command)."""
        command, *rest = args
        return subprocess.run(
            [EVALD, command, "--target", self.target, *rest],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **(env or {})},
        )

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Closes the clients, signals the daemon and waits for it; returns its exit status."""
        for client in self.clients:
            client.close()
        self.clients.clear()
        return super().stop(signum, timeout_s)


def start_daemon(
    root: Path,
    config_text: str,
    *,
    state_dir: Path | None = None,
    socket_path: Path | None = None,
    listen: str | None = None,
    metrics_port: int | None = None,
    prefix: Sequence[str] = (),
    wait: bool = True,
    extra_args: Sequence[str] = (),
    tls_ca: Path | None = None,
    own_session: bool = False,
) -> Daemon:
    """Starts ``evald serve`` with ``config_text`` and waits until it serves."""
    return harness.start_daemon(
        root,
        config_text,
        state_dir=state_dir,
        socket_path=socket_path,
        listen=listen,
        metrics_port=metrics_port,
        prefix=prefix,
        wait=wait,
        extra_args=extra_args,
        tls_ca=tls_ca,
        own_session=own_session,
        factory=Daemon,
    )


def wait_serving(daemon: Daemon, listen: str | None = None, tls_ca: Path | None = None) -> None:
    harness.wait_serving(daemon, listen, tls_ca=tls_ca)


def module(kind: str, name: str, param: Any = None, **options: Any) -> bytes:
    """A WAT test module (:func:`evald.testing.named_guest`) named and tagged ``name``."""
    return named_guest(kind, name, param, **options)


def outcome(response: Any) -> str:
    """``ok`` or the error code name of an ``EvaluateResponse``."""
    from evald.contract import ErrorCode

    if response.WhichOneof("outcome") == "value":
        return "ok"
    return ErrorCode.from_proto(response.error.code).value


def assert_still_serving(daemon: Daemon) -> None:
    """The same daemon answers a normal call correctly (an echo module, and calc if built)."""
    local = daemon.client()
    names = {info.name for info in local.list_evaluators()}
    if "serving_echo" not in names:
        local.register(module("echo", "serving_echo"))
    response = local.evaluate("serving_echo", b"still here")
    assert (outcome(response), response.value) == ("ok", "still here")
    if wasm_path("calc").exists() and "calc" in names:
        response = local.evaluate("calc", "17 * 23 + 91")
        assert (outcome(response), response.value) == ("ok", "482")
