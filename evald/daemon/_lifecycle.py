"""How the daemon meets its process: the gRPC server it opens, the ports it binds, the signals it
obeys.

Why apart from the daemon's state: these are the parts that touch the operating system and the
deployment (socket files and their modes, TLS files (regular files only,
:mod:`~evald.daemon._operator_files`), refusing clear-text TCP off loopback,
systemd's readiness protocol, SIGTERM/SIGINT/SIGHUP), and each has its own failure a deployer
must be able to read: an address in use, a stale socket left by ``kill -9`` (removed), a live
daemon already on the path (refused), a path over the kernel's limit.

* :func:`grpc_server` builds the ``grpc.aio`` server with the daemon's message and stream
  limits, the gatekeeper, the evaluator service, health and reflection;
* :func:`bind` binds it to ``[server] listen`` (a unix socket created with ``socket_mode``, or
  TCP, with TLS unless on loopback or explicitly allowed);
* :func:`run_until_signal` serves until SIGTERM or SIGINT, then drains (a second signal leaves
  at once).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
from pathlib import Path
from typing import Any, Final, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from evald.contract import ErrorCode, EvaldError
from evald.daemon import _sdnotify
from evald.daemon._config import Config, ServerSettings
from evald.daemon._gatekeeping import SERVICE_NAME, receive_limit, send_limit
from evald.daemon._grpc_gate import Gatekeeper
from evald.daemon._operator_files import read_regular_file
from evald.daemon._service import ControlPlane, add_service
from evald.daemon._transport import Core

__all__ = ["Served", "bind", "check_unix_socket", "grpc_server", "run_until_signal"]

_log = logging.getLogger("evald.server")

#: Longest unix socket path the kernel accepts (sun_path is 108 bytes with the NUL).
_MAX_UNIX_PATH: Final = 107
_LOOPBACK_HOSTS: Final = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


class Served(Core, ControlPlane, Protocol):
    """The daemon as its process sees it: what the gRPC server serves, and how it starts and
    stops (:class:`evald.daemon.EvaldServer` is one)."""

    config: Config
    listen: str

    async def start(self) -> None: ...

    async def stop(self, grace_s: float | None = None) -> None: ...

    async def reload(self) -> bool: ...


def grpc_server(daemon: Served) -> tuple[Any, health_aio.HealthServicer]:
    """The daemon's ``grpc.aio`` server, not yet bound or started, and its health servicer.

    Message limits come from ``max_message_bytes``, ``max_batch_items`` and the largest
    ``input_bytes`` of any tenant; every call passes the gatekeeper
    (:mod:`evald.daemon._grpc_gate`) before its body is read.
    """
    config = daemon.config
    settings = config.server
    largest_input = max(
        (tenant.limits.input_bytes for tenant in config.tenants),
        default=config.default_limits.input_bytes,
    )
    server = grpc.aio.server(
        interceptors=(Gatekeeper(daemon, over_unix=daemon.listen.startswith("unix:")),),
        options=(
            (
                "grpc.max_receive_message_length",
                receive_limit(settings.max_message_bytes, settings.max_batch_items, largest_input),
            ),
            (
                "grpc.max_send_message_length",
                send_limit(settings.max_message_bytes, settings.max_batch_items),
            ),
            ("grpc.max_concurrent_streams", settings.max_streams_per_connection),
            # No flow-control windows grown by bandwidth probing: what a call may have in flight
            # before the daemon reads it stays at HTTP/2's 64 KiB per stream.
            ("grpc.http2.bdp_probe", 0),
            ("grpc.so_reuseport", 0),
            # Connections with no call for this long are closed (the clients reconnect).
            *_idle_option(settings.idle_timeout_s),
        ),
        # No gRPC call cap: its refusal is an untyped RESOURCE_EXHAUSTED for everyone alike. The
        # gatekeeper counts every call instead: tenants in their shares of max_concurrent_rpcs,
        # callers without a token in open_calls.
        maximum_concurrent_rpcs=None,
    )
    add_service(daemon, daemon, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    return server, health


def _idle_option(idle_timeout_s: float) -> tuple[tuple[str, int], ...]:
    if idle_timeout_s <= 0:
        return ()
    return (("grpc.max_connection_idle_ms", max(1, int(idle_timeout_s * 1000))),)


def bind(server: Any, listen: str, settings: ServerSettings) -> Path | None:
    """Binds ``server`` to ``listen``; returns the unix socket's file (None for TCP).

    Raises:
        EvaldError: ``unavailable`` when the address is taken (or a live daemon serves the
            socket); ``invalid_argument`` for a bad socket path, unreadable TLS files, or
            clear-text TCP off loopback without ``allow_insecure_tcp``.
    """
    if listen.startswith("unix:"):
        raw = listen[len("unix:") :]
        if raw.startswith("//"):  # unix:///abs/path
            raw = raw[2:]
        path = Path(raw).expanduser().absolute()
        check_unix_socket(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Create the socket with the final mode: no window in which others may connect.
        previous = os.umask(0o777 & ~settings.socket_mode)
        try:
            bound = _add_port(server, f"unix:{path}")
        finally:
            os.umask(previous)
        if not bound:
            raise EvaldError(ErrorCode.UNAVAILABLE, f"cannot listen on unix:{path}")
        return path
    host, _, _port = listen.rpartition(":")
    if settings.tls_cert:
        try:
            key = read_regular_file(settings.tls_key)
            cert = read_regular_file(settings.tls_cert)
            ca = read_regular_file(settings.tls_client_ca) if settings.tls_client_ca else None
        except OSError as exc:
            raise EvaldError(ErrorCode.INVALID_ARGUMENT, f"cannot read a TLS file: {exc}") from exc
        credentials = grpc.ssl_server_credentials(
            ((key, cert),), root_certificates=ca, require_client_auth=ca is not None
        )
        bound = _add_port(server, listen, credentials)
    else:
        if host not in _LOOPBACK_HOSTS and not settings.allow_insecure_tcp:
            raise EvaldError(
                ErrorCode.INVALID_ARGUMENT,
                f"refusing to listen on {listen} without TLS: tokens would cross the "
                "network in clear text. Set tls_cert/tls_key, listen on 127.0.0.1, or set "
                "allow_insecure_tcp = true",
            )
        bound = _add_port(server, listen)
    if not bound:
        raise EvaldError(ErrorCode.UNAVAILABLE, f"cannot listen on {listen}")
    return None


def _add_port(server: Any, address: str, credentials: Any = None) -> int:
    try:
        if credentials is None:
            return int(server.add_insecure_port(address))
        return int(server.add_secure_port(address, credentials))
    except RuntimeError:
        raise EvaldError(
            ErrorCode.UNAVAILABLE,
            f"cannot listen on {address}: the address is in use or not available here",
        ) from None


def check_unix_socket(path: Path) -> None:
    """Refuses to take over a socket a live daemon serves; removes a stale one (after kill -9).

    Raises:
        EvaldError: ``invalid_argument`` for a path over the kernel's limit or a file that is
            not a socket; ``unavailable`` when a daemon answers on it.
    """
    if len(str(path).encode()) > _MAX_UNIX_PATH:
        raise EvaldError(
            ErrorCode.INVALID_ARGUMENT,
            f"unix socket path is {len(str(path).encode())} bytes, over the kernel's limit of "
            f"{_MAX_UNIX_PATH}: {path}",
        )
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise EvaldError(
            ErrorCode.INVALID_ARGUMENT, f"{path} exists and is not a socket; refusing to replace it"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)  # nobody listens: left over from a daemon that died
        return
    finally:
        probe.close()
    raise EvaldError(
        ErrorCode.UNAVAILABLE,
        f"another daemon is already serving on {path}; stop it or pass a different --listen",
    )


async def run_until_signal(daemon: Served) -> None:
    """Starts ``daemon``, serves until SIGTERM or SIGINT, then drains it and returns.

    A second signal while draining exits the process at once (status 1). SIGHUP reloads: the
    config file is read again and its tenants applied without dropping calls
    (:meth:`evald.daemon.EvaldServer.reload`); reloads queue, one at a time.

    Raises:
        EvaldError: start-up failed (nothing is left running).
    """
    await daemon.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():  # a second signal: stop draining and leave now
            _log.warning("forced exit", extra={"fields": {"signal": signal.Signals(signum).name}})
            os._exit(1)
        _log.info("signal", extra={"fields": {"signal": signal.Signals(signum).name}})
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    reloads: set[asyncio.Task[bool]] = set()

    def on_reload() -> None:
        _log.info("signal", extra={"fields": {"signal": "SIGHUP"}})
        task = loop.create_task(daemon.reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_reload)
    # Readiness for systemd Type=notify (a no-op outside systemd). The status starts with
    # "serving": the deploy tests check it.
    _sdnotify.notify_ready(f"serving on {daemon.listen}")
    try:
        await stop.wait()
        _sdnotify.notify_stopping("draining")
        await daemon.stop()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)
