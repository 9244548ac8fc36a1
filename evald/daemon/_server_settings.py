"""The ``[server]`` table: where the daemon listens and keeps its state, and the bounds of its
transports (messages, streams, connections, the compile queue).

Why apart: these settings are the daemon's process-wide knobs, read by its lifecycle, its
transports and its admission; their defaults are written once, on :class:`ServerSettings`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from evald.contract import default_target
from evald.daemon._config_table import KIB, MIB, ConfigTable
from evald.daemon._cpu_affinity import CPU_LIST_EXAMPLE, parse_cpu_list
from evald.host import DEFAULT_COMPILE_MEMORY_BYTES

__all__ = ["ServerSettings", "default_state_dir", "server_from_table"]

_LOG_LEVELS = ("debug", "info", "warning", "error")


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/evald``, else ``~/.local/state/evald``: where registered modules live."""
    state_home = os.environ.get("XDG_STATE_HOME", "").strip()
    base = Path(state_home) if state_home else Path.home() / ".local" / "state"
    return base / "evald"


@dataclass(frozen=True)
class ServerSettings:
    """The ``[server]`` table: transport, storage and process-wide behaviour.

    ``max_concurrent_rpcs`` bounds the tenants' gRPC calls in flight, each tenant guaranteed an
    equal share (more get ``quota_exceeded``); calls to the services that need no token (health)
    have their own ``open_calls`` (more get ``unavailable``) and requests of at most
    ``open_request_bytes``; ``max_streams_per_connection`` bounds the HTTP/2 streams one
    connection may open. ``data_max_connections`` is shared the same way by the data path's
    tenants, and ``data_unauthenticated_connections`` bounds its connections that have not
    authenticated yet. A request message must arrive whole within ``frame_timeout_s`` (a data
    path frame from its header, a unary call's request from the call's start); a stream or
    connection with nothing in flight that receives nothing for ``idle_timeout_s`` is closed
    (0: never). ``stream_unread_bytes`` bounds one stream's output its client has not read yet;
    a stream whose client reads nothing for ``stream_stall_s`` while at that bound is ended
    with ``quota_exceeded``. Registrations compile in a separate, niced worker process, one at
    a time: at most ``compile_queue`` wait or compile, at most ``compile_queue_per_tenant`` of
    them one tenant's (more are refused with ``unavailable``), served round-robin across
    tenants; one that uses more than ``compile_cpu_s`` of CPU, ``compile_memory_bytes`` of
    memory or ``compile_timeout_s`` of wall time is refused (one starved of CPU by a busy machine
    until ``compile_timeout_s`` gets ``unavailable`` instead: it may be retried). A worker
    running a heavy tenant's items (one of its evaluations used more than 5 ms of CPU in the
    last second) runs at nice ``heavy_tenant_nice`` until the item's deadline (0: off), so
    other tenants' light calls go first on a busy machine (:mod:`evald.daemon._priority`).
    ``cpus`` (a Linux cpu-list, empty: every CPU the daemon is given) confines the workers
    and the compile worker, and under ``evald serve`` the whole daemon, to those CPUs, so an
    engine bound to the others never shares a core with tenants' work
    (:mod:`evald.daemon._cpu_affinity`); ``threads`` then defaults to their number.
    """

    listen: str = ""
    state_dir: str = ""
    threads: int = 0
    metrics_listen: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    allow_insecure_tcp: bool = False
    max_message_bytes: int = 8 * MIB
    max_batch_items: int = 4096
    max_concurrent_rpcs: int = 1024
    max_streams_per_connection: int = 256
    stream_unread_bytes: int = 16 * MIB
    stream_stall_s: float = 30.0
    compile_queue: int = 8
    compile_queue_per_tenant: int = 2
    compile_cpu_s: float = 10.0
    compile_timeout_s: float = 30.0
    compile_memory_bytes: int = DEFAULT_COMPILE_MEMORY_BYTES
    socket_mode: int = 0o600
    log_level: str = "info"
    shutdown_grace_s: float = 10.0
    data_listen: str = ""
    data_max_connections: int = 128
    data_unauthenticated_connections: int = 16
    open_calls: int = 16
    open_request_bytes: int = 4 * KIB
    frame_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    heavy_tenant_nice: int = 19
    cpus: frozenset[int] = frozenset()

    @property
    def resolved_listen(self) -> str:
        """``listen``, or :func:`default_target` when empty."""
        return self.listen or default_target()

    @property
    def resolved_state_dir(self) -> Path:
        """``state_dir``, or :func:`default_state_dir` when empty."""
        return Path(self.state_dir).expanduser() if self.state_dir else default_state_dir()

    @property
    def resolved_threads(self) -> int:
        """Guest worker threads: ``threads``, or when 0 the number of ``cpus``, else of the
        machine's CPUs."""
        if self.threads > 0:
            return self.threads
        return len(self.cpus) if self.cpus else max(1, os.cpu_count() or 1)

    @property
    def is_unix(self) -> bool:
        """Whether the daemon listens on a unix socket."""
        return self.resolved_listen.startswith("unix:")


def _socket_mode(table: ConfigTable, base: ServerSettings) -> int:
    """``socket_mode``: an octal string of permission bits (``"0600"``)."""
    mode_text = table.get_str("socket_mode", f"{base.socket_mode:04o}")
    try:
        socket_mode = int(mode_text, 8)
    except ValueError:
        message = f'expected an octal mode such as "0600", got {mode_text!r}'
        raise table.error("socket_mode", message) from None
    if socket_mode & ~0o777:
        message = f"expected permission bits only (<= 0777), got {mode_text!r}"
        raise table.error("socket_mode", message)
    return socket_mode


def _cpus(table: ConfigTable, base: ServerSettings) -> frozenset[int]:
    """``cpus``: a Linux cpu-list string (which CPUs, never how many); empty: every CPU the
    daemon is given, the default (as ``metrics_listen = ""`` is off)."""
    value = table.data.get("cpus")
    if value is not None and not isinstance(value, str):
        message = (
            f"expected a Linux CPU list string such as {CPU_LIST_EXAMPLE} (which CPUs, not "
            f"how many), got {value!r}"
        )
        raise table.error("cpus", message)
    text = table.get_str("cpus", "")
    if value is None or not text.strip():  # empty, as the packaged config states it: unset
        return base.cpus
    try:
        return parse_cpu_list(text)
    except ValueError as exc:
        raise table.error("cpus", str(exc)) from None


def _addresses(table: ConfigTable, base: ServerSettings) -> tuple[str, str]:
    """``listen`` (unix:PATH or HOST:PORT) and ``data_listen`` (unix:PATH only)."""
    listen = table.get_str("listen", base.listen)
    if listen and not listen.startswith("unix:") and ":" not in listen:
        raise table.error("listen", f"expected unix:PATH or HOST:PORT, got {listen!r}")
    data_listen = table.get_str("data_listen", base.data_listen)
    if data_listen and not data_listen.startswith("unix:"):
        message = f"the data path listens on a unix socket only: unix:PATH, got {data_listen!r}"
        raise table.error("data_listen", message)
    return listen, data_listen


def _check_server(table: ConfigTable, settings: ServerSettings) -> None:
    """What only the table as a whole can tell: TLS files named together, a metrics address."""
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise table.error("tls_cert", "tls_cert and tls_key must be given together")
    if settings.tls_client_ca and not settings.tls_cert:
        raise table.error("tls_client_ca", "mutual TLS needs tls_cert and tls_key as well")
    if settings.metrics_listen and ":" not in settings.metrics_listen:
        raise table.error("metrics_listen", f"expected HOST:PORT, got {settings.metrics_listen!r}")


def server_from_table(table: ConfigTable) -> ServerSettings:
    """The ``[server]`` table, each key checked.

    Raises:
        ConfigError: an unknown key or a bad value (the message names the key).
    """
    base = ServerSettings()
    socket_mode = _socket_mode(table, base)
    listen, data_listen = _addresses(table, base)
    settings = ServerSettings(
        listen=listen,
        state_dir=table.get_str("state_dir", base.state_dir),
        threads=table.get_int("threads", base.threads),
        metrics_listen=table.get_str("metrics_listen", base.metrics_listen),
        tls_cert=table.get_str("tls_cert", base.tls_cert),
        tls_key=table.get_str("tls_key", base.tls_key),
        tls_client_ca=table.get_str("tls_client_ca", base.tls_client_ca),
        allow_insecure_tcp=table.get_bool("allow_insecure_tcp", base.allow_insecure_tcp),
        max_message_bytes=table.get_size(
            "max_message_bytes", base.max_message_bytes, minimum=64 * KIB
        ),
        max_batch_items=table.get_int("max_batch_items", base.max_batch_items, minimum=1),
        max_concurrent_rpcs=table.get_int(
            "max_concurrent_rpcs", base.max_concurrent_rpcs, minimum=1
        ),
        max_streams_per_connection=table.get_int(
            "max_streams_per_connection", base.max_streams_per_connection, minimum=1
        ),
        stream_unread_bytes=table.get_size(
            "stream_unread_bytes", base.stream_unread_bytes, minimum=64 * KIB
        ),
        stream_stall_s=table.get_float("stream_stall_s", base.stream_stall_s, minimum=0.1),
        compile_queue=table.get_int("compile_queue", base.compile_queue, minimum=1),
        compile_queue_per_tenant=table.get_int(
            "compile_queue_per_tenant", base.compile_queue_per_tenant, minimum=1
        ),
        compile_memory_bytes=table.get_size(
            "compile_memory_bytes", base.compile_memory_bytes, minimum=64 * MIB
        ),
        compile_cpu_s=table.get_float("compile_cpu_s", base.compile_cpu_s, minimum=1.0),
        compile_timeout_s=table.get_float("compile_timeout_s", base.compile_timeout_s, minimum=1.0),
        socket_mode=socket_mode,
        log_level=table.get_str("log_level", base.log_level, choices=_LOG_LEVELS),
        shutdown_grace_s=table.get_float("shutdown_grace_s", base.shutdown_grace_s),
        data_listen=data_listen,
        data_max_connections=table.get_int(
            "data_max_connections", base.data_max_connections, minimum=1
        ),
        data_unauthenticated_connections=table.get_int(
            "data_unauthenticated_connections", base.data_unauthenticated_connections, minimum=1
        ),
        open_calls=table.get_int("open_calls", base.open_calls, minimum=1),
        open_request_bytes=table.get_size(
            "open_request_bytes", base.open_request_bytes, minimum=256
        ),
        frame_timeout_s=table.get_float("frame_timeout_s", base.frame_timeout_s, minimum=0.1),
        heavy_tenant_nice=table.get_int(
            "heavy_tenant_nice", base.heavy_tenant_nice, minimum=0, maximum=19
        ),
        idle_timeout_s=table.get_float("idle_timeout_s", base.idle_timeout_s),
        cpus=_cpus(table, base),
    )
    _check_server(table, settings)
    table.finish()
    return settings
