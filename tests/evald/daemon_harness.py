"""Runs the real daemon (``evald serve``) as a subprocess on a real unix socket, for tests.

:func:`start_daemon` writes a config, starts the daemon, waits until its health service says
SERVING and returns a :class:`Daemon` handle; the JSON-lines log goes to a file the handle can
read back. Nothing here talks to the daemon other than through its public API and its CLI.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evald._client import CallError, Client
from evald._config import hash_token
from evald._toolchain import append_custom_section

EVALD = str(Path(sys.executable).with_name("evald"))
START_TIMEOUT_S = 60.0

#: Tokens of the test config's tenants (the config holds only their hashes).
TOKENS = {
    name: f"{name}-token-0123456789"
    for name in ("limits", "nofuel", "alpha", "beta", "narrow", "metered", "viewer", "cramped")
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tenant_block(name: str, *, token: bool = True, **settings: Any) -> str:
    """One ``[[tenants]]`` table; keyword ``limits`` is a dict for ``[tenants.limits]``."""
    limits: dict[str, Any] = settings.pop("limits", {})
    lines = ["[[tenants]]", f'name = "{name}"']
    if token:
        lines.append(f'token_sha256 = "{hash_token(TOKENS[name])}"')
    for key, value in settings.items():
        lines.append(f"{key} = {json.dumps(value)}")
    if limits:
        lines.append("[tenants.limits]")
        lines.extend(f"{key} = {json.dumps(value)}" for key, value in limits.items())
    return "\n".join(lines) + "\n"


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
            tenant_block("beta", evaluators=["*"], allow_register=True, max_modules=64),
            tenant_block("narrow", allow_register=True, limits={"max_concurrency": 2}),
            tenant_block("metered", allow_register=True, limits={"rate_per_s": 0.01, "burst": 3}),
            tenant_block("viewer", evaluators=["calc"]),
            tenant_block("cramped", allow_register=True, max_modules=1),
        ]
    )


@dataclass
class Daemon:
    """A running ``evald serve`` subprocess."""

    process: subprocess.Popen[bytes]
    socket_path: Path
    state_dir: Path
    config_path: Path
    log_path: Path
    metrics_port: int | None = None
    clients: list[Client] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"unix:{self.socket_path}"

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

    def log_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line]

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Signals the daemon and waits for it; returns its exit status."""
        for client in self.clients:
            client.close()
        self.clients.clear()
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        """kill -9: no drain, no clean-up (the socket file and the lock stay behind)."""
        self.stop(signal.SIGKILL)


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
) -> Daemon:
    """Starts ``evald serve`` with ``config_text`` and waits until it serves."""
    root.mkdir(parents=True, exist_ok=True)
    config_path = root / "evald.toml"
    config_path.write_text(config_text)
    socket_path = socket_path or root / "evald.sock"
    state_dir = state_dir or root / "state"
    log_path = root / f"daemon-{time.monotonic_ns()}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                *prefix,
                EVALD,
                "serve",
                "--config",
                str(config_path),
                "--listen",
                listen or f"unix:{socket_path}",
                "--state-dir",
                str(state_dir),
                *extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    daemon = Daemon(process, socket_path, state_dir, config_path, log_path, metrics_port)
    if wait:
        wait_serving(daemon, listen, tls_ca=tls_ca)
    return daemon


def wait_serving(daemon: Daemon, listen: str | None = None, tls_ca: Path | None = None) -> None:
    give_up = time.monotonic() + START_TIMEOUT_S
    with Client(listen or daemon.target, timeout_s=2.0, tls_ca=tls_ca) as client:
        while True:
            if daemon.process.poll() is not None:
                raise RuntimeError(
                    f"evald serve exited with {daemon.process.returncode}:\n"
                    + daemon.log_path.read_text()
                )
            try:
                if client.health() == "SERVING":
                    return
            except CallError:
                pass
            if time.monotonic() > give_up:
                daemon.stop(signal.SIGKILL)
                raise RuntimeError(
                    "evald serve did not become healthy:\n" + daemon.log_path.read_text()
                )
            time.sleep(0.05)


def padded(wasm: bytes, total_bytes: int) -> bytes:
    """``wasm`` with a custom section that makes it exactly ``total_bytes`` long."""
    for name in ("pad", "pad_"):  # a longer name steps over a LEB128 length boundary
        estimate = total_bytes - len(wasm) - len(name) - 6
        for payload_bytes in range(max(0, estimate - 8), estimate + 8):
            candidate = append_custom_section(wasm, name, b"\0" * payload_bytes)
            if len(candidate) == total_bytes:
                return candidate
    raise ValueError(f"cannot pad a {len(wasm)}-byte module to {total_bytes} bytes")


def module(kind: str, name: str, param: Any = None, **options: Any) -> bytes:
    """A WAT test module (``wat_modules.guest``) whose manifest name and tag are ``name``."""
    from wat_modules import guest, manifest_bytes

    return guest(
        kind,
        param,
        manifest=manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1"),
        **options,
    )


def outcome(response: Any) -> str:
    """``ok`` or the error code name of an ``EvaluateResponse``."""
    from evald._errors import ErrorCode

    if response.WhichOneof("outcome") == "value":
        return "ok"
    return ErrorCode.from_proto(response.error.code).value
