"""The daemon's configuration: one typed place, loaded from TOML, with errors that name the bad key.

Everything the daemon does differently per deployment lives here: where it listens, where it keeps
registered modules, the host's engine-wide settings, the default limits and the tenants. A config
file names only what it changes; every key has a default that works out of the box
(``evald/daemon/default_config.toml`` ships with the package and is used when no file is given).

Sizes may be written as integers (bytes) or as strings with a binary unit (``"64MiB"``,
``"256KiB"``). Tokens are never stored: a tenant carries the hex SHA-256 of its token
(``evald hash-token`` makes one).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

from evald.contract import STANDARD_EVALUATORS, default_target
from evald.host import DEFAULT_COMPILE_MEMORY_BYTES, HostConfig, Limits

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "Config",
    "ConfigError",
    "HostSettings",
    "ServerSettings",
    "StoreSettings",
    "TenantConfig",
    "TenantLimits",
    "check_store_url",
    "default_state_dir",
    "hash_token",
    "is_tenant_name",
    "load_config",
    "parse_config",
    "parse_limits",
    "parse_size",
    "tenant_from_store",
]

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent / "default_config.toml"

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

_TENANT_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_SIZE = re.compile(r"\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*")
_SIZE_UNITS = {None: 1, "B": 1, "KiB": KIB, "MiB": MIB, "GiB": GIB}
_LOG_LEVELS = ("debug", "info", "warning", "error")
_ISOLATION_MODES = ("reuse", "fresh")
_ALLOCATORS = ("auto", "pooling", "default")

#: The one home of every per-evaluation and engine default (``evald/host/_limits.py``); the config
#: tables below take their defaults from these, and tests check every shipped config against them.
_LIMITS = Limits()
_HOST = HostConfig()

IsolationMode = Literal["reuse", "fresh"]
AllocatorKind = Literal["auto", "pooling", "default"]


class ConfigError(ValueError):
    """The config is invalid; the message names the file and the key, and says what is expected."""


def hash_token(token: str) -> str:
    """The hex SHA-256 a tenant's ``token_sha256`` holds for ``token``.

    Tokens are expected to be long random strings (``evald hash-token`` makes them), so an
    unsalted hash is enough to keep the config file from being a credential.
    """
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/evald``, else ``~/.local/state/evald``: where registered modules live."""
    state_home = os.environ.get("XDG_STATE_HOME", "").strip()
    base = Path(state_home) if state_home else Path.home() / ".local" / "state"
    return base / "evald"


def parse_size(value: object, where: str = "size") -> int:
    """Bytes from an integer or a string such as ``"64MiB"``.

    Raises:
        ConfigError: not a non-negative integer or a size string (the message names ``where``).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{where}: expected a size >= 0, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match:
            return int(match.group(1)) * _SIZE_UNITS[match.group(2)]
    raise ConfigError(
        f'{where}: expected a size (bytes, or a string like "64MiB", "256KiB"), got {value!r}'
    )


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may use. Per evaluation: fuel, memory, deadline, input/output size; per
    tenant: evaluations in flight and the admission rate.

    ``max_concurrency`` counts evaluations admitted and not yet finished (queued or running);
    one more is refused with ``quota_exceeded`` instead of waiting, so a burst never queues without
    bound. ``rate_per_s`` is a token bucket of ``burst`` evaluations refilled at that rate;
    ``0`` turns the rate limit off. ``fuel = 0`` turns fuel metering off for this tenant (only the
    deadline then stops a loop). ``max_running`` caps the guest workers the tenant holds at once,
    so one tenant's slow work cannot take every worker from the others; its admitted items over
    the cap wait in the tenant's queue. ``0`` means ``max(1, threads - 1)``: with two or more
    workers one is always left for other tenants. ``max_calls`` counts the tenant's unary
    calls, streams and data-path connections; ``unread_bytes`` the output of its streams and
    connections that their clients have not read yet; ``request_bytes`` the request bytes the
    daemon holds for it (a data-path frame from its header on, a gRPC message once received)
    until the items in them are admitted: past it the daemon stops reading the tenant's streams
    and connections. ``instance_cache_bytes`` bounds the linear memory of the instances kept
    for reuse for the tenant, every worker together (``0``: none is kept; every call
    instantiates).
    """

    fuel: int = _LIMITS.fuel
    memory_bytes: int = _LIMITS.memory_bytes
    deadline_ms: int = _LIMITS.deadline_ms
    input_bytes: int = _LIMITS.input_bytes
    output_bytes: int = _LIMITS.output_bytes
    max_concurrency: int = 256
    rate_per_s: float = 0.0
    burst: int = 0
    max_running: int = 0
    max_calls: int = 256
    unread_bytes: int = 64 * MIB
    request_bytes: int = 64 * MIB
    instance_cache_bytes: int = _LIMITS.instance_cache_bytes

    def running_cap(self, threads: int, *, shared: bool = True) -> int:
        """Workers the tenant may hold at once on a pool of ``threads``.

        The default keeps one worker out of any single tenant's reach, so another tenant's call
        never waits behind a full deadline. A daemon serving one tenant (``shared=False``) has
        nobody to keep it for, and gives that tenant every worker.
        """
        if self.max_running > 0:
            return self.max_running
        return max(1, threads - 1) if shared else threads

    @property
    def effective_burst(self) -> int:
        """The bucket size: ``burst``, or one second's worth of the rate when ``burst`` is 0."""
        if self.burst > 0:
            return self.burst
        return max(1, math.ceil(self.rate_per_s))


@dataclass(frozen=True)
class TenantConfig:
    """One tenant: who it is (the hashes of its tokens, or none for the unix-socket-only
    tenant), its limits, which standard evaluators it may call and whether it may register its
    own.

    A tenant may hold several tokens at once, so a token rotates with no gap: the new token's
    hash is added, clients move to it, then the old hash is removed (``evald tenants rotate``
    and ``revoke``, or the config's ``token_sha256s`` and ``evald reload``). ``source`` says
    where the tenant is defined: ``config`` (this daemon's TOML) or ``store`` (the fleet store).
    """

    name: str
    token_sha256s: tuple[str, ...]
    limits: TenantLimits
    evaluators: tuple[str, ...] = ()
    allow_register: bool = False
    max_modules: int = 16
    source: Literal["config", "store"] = "config"

    @property
    def tokenless(self) -> bool:
        """True for the tenant served without a token, and only on the unix socket."""
        return not self.token_sha256s and self.source == "config"

    def may_use_standard(self, name: str) -> bool:
        """Whether this tenant's ``evaluators`` list admits the standard evaluator ``name``."""
        return "*" in self.evaluators or name in self.evaluators


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
        """Guest worker threads: ``threads``, or the number of CPUs when 0."""
        return self.threads if self.threads > 0 else max(1, os.cpu_count() or 1)

    @property
    def is_unix(self) -> bool:
        """Whether the daemon listens on a unix socket."""
        return self.resolved_listen.startswith("unix:")


@dataclass(frozen=True)
class HostSettings:
    """The ``[host]`` table: engine-wide settings of the wasm host
    (``evald.host.HostConfig``).

    ``cache_dir`` empty means ``<state_dir>/cache``; ``compile_cache = false`` turns the on-disk
    compiled-module cache off. ``allocator``, ``pool_instances`` and ``pool_memory_bytes`` tune
    wasmtime's pooling allocator (used by ``isolation = "fresh"``; a tenant's memory cap cannot
    exceed ``pool_memory_bytes`` there); ``instances_per_thread`` bounds the reuse cache.
    """

    max_wasm_stack_bytes: int = _HOST.max_wasm_stack_bytes
    module_bytes: int = _HOST.module_bytes
    epoch_tick_ms: float = _HOST.epoch_tick_ms
    isolation: IsolationMode = _HOST.isolation
    compile_cache: bool = True
    cache_dir: str = ""
    load_fuel: int = _HOST.load_fuel
    load_deadline_ms: int = _HOST.load_deadline_ms
    allocator: AllocatorKind = _HOST.allocator
    pool_instances: int = _HOST.pool_instances
    pool_memory_bytes: int = _HOST.pool_memory_bytes
    instances_per_thread: int = _HOST.instances_per_thread


@dataclass(frozen=True)
class StoreSettings:
    """The ``[store]`` table: where tenants and registered modules live.

    Empty ``url`` (the default) is the embedded store: tenants from this file, modules in the
    state folder, for one machine. A ``postgresql://`` URL is the fleet store shared by every
    daemon (docs/operations.md, "A fleet"): tenants, tokens, limits and modules in PostgreSQL,
    followed live; the state folder then holds the local cache that a restart serves while the
    store is down. The password is never part of the URL: ``password_file`` names a file that
    holds it, ``password_env`` an environment variable (libpq's own ``PGPASSWORD`` and
    ``PGPASSFILE`` work too). ``poll_s`` is how often a daemon checks the store's revision
    besides its notifications; ``connect_timeout_s`` bounds one attempt to reach it;
    ``max_stale_s`` is how long a daemon that cannot confirm it is current keeps serving the
    store's tenants (0: for ever; docs/operations.md, "A fleet", says why 300).
    """

    url: str = ""
    password_file: str = ""
    password_env: str = ""
    poll_s: float = 5.0
    connect_timeout_s: float = 3.0
    max_stale_s: float = 300.0

    @property
    def fleet(self) -> bool:
        """Whether the fleet store (PostgreSQL) is configured."""
        return bool(self.url)

    def password(self) -> str | None:
        """The store's password from ``password_file`` or ``password_env`` (None: libpq's own
        ways, or none).

        Raises:
            ConfigError: the file cannot be read, or the variable is not set.
        """
        if self.password_file:
            try:
                text = Path(self.password_file).expanduser().read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
                raise ConfigError(
                    f"store.password_file: cannot read {self.password_file}: {reason}"
                ) from None
            return text.strip("\r\n")
        if self.password_env:
            value = os.environ.get(self.password_env)
            if value is None:
                raise ConfigError(
                    f"store.password_env: the environment variable {self.password_env} is not set"
                )
            return value
        return None


@dataclass(frozen=True)
class Config:
    """The whole configuration. ``source`` names the file it came from (for messages, and the
    file a live reload reads again)."""

    server: ServerSettings = field(default_factory=ServerSettings)
    host: HostSettings = field(default_factory=HostSettings)
    default_limits: TenantLimits = field(default_factory=TenantLimits)
    tenants: tuple[TenantConfig, ...] = ()
    source: str = "<defaults>"
    store: StoreSettings = field(default_factory=StoreSettings)

    def tenant(self, name: str) -> TenantConfig | None:
        """The tenant called ``name``, if any."""
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        return None

    def with_overrides(self, *, listen: str | None = None, state_dir: str | None = None) -> Config:
        """A copy with command-line overrides applied (``evald serve --listen/--state-dir``)."""
        server = self.server
        if listen:
            server = replace(server, listen=listen)
        if state_dir:
            server = replace(server, state_dir=state_dir)
        return replace(self, server=server)


class _Table:
    """Reads one TOML table with type checks; :meth:`finish` refuses keys nobody asked for."""

    def __init__(self, data: object, path: str, source: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: {path}: expected a table, got {type(data).__name__}")
        self.data: Mapping[str, Any] = data
        self.path = path
        self.source = source
        self.seen: set[str] = set()

    def _where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self._where(key)}: {message}")

    def _get(self, key: str) -> Any:
        self.seen.add(key)
        return self.data.get(key)

    def has(self, key: str) -> bool:
        return key in self.data

    def get_int(
        self, key: str, default: int, *, minimum: int = 0, maximum: int | None = None
    ) -> int:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected an integer, got {value!r}")
        if value < minimum:
            raise self.error(key, f"expected an integer >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.error(key, f"expected an integer <= {maximum}, got {value}")
        return value

    def get_float(self, key: str, default: float, *, minimum: float = 0.0) -> float:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"expected a number, got {value!r}")
        if not math.isfinite(value) or value < minimum:
            raise self.error(key, f"expected a finite number >= {minimum}, got {value}")
        return float(value)

    def get_size(self, key: str, default: int, *, minimum: int = 0) -> int:
        value = self._get(key)
        if value is None:
            return default
        try:
            size = parse_size(value, self._where(key))
        except ConfigError as exc:
            raise ConfigError(f"{self.source}: {exc}") from None
        if size < minimum:
            raise self.error(key, f"expected a size >= {minimum} bytes, got {size}")
        return size

    def get_str(self, key: str, default: str, *, choices: tuple[str, ...] = ()) -> str:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, got {value!r}")
        if choices and value not in choices:
            raise self.error(key, f"expected one of {', '.join(choices)}; got {value!r}")
        return value

    def get_bool(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value

    def get_str_list(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self.error(key, f"expected a list of strings, got {value!r}")
        return tuple(value)

    def get_table(self, key: str) -> _Table:
        value = self._get(key)
        return _Table({} if value is None else value, self._where(key), self.source)

    def get_tables(self, key: str) -> list[_Table]:
        value = self._get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.error(key, "expected an array of tables ([[" + key + "]])")
        return [
            _Table(item, f"{self._where(key)}[{index}]", self.source)
            for index, item in enumerate(value)
        ]

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            expected = ", ".join(sorted(self.seen))
            raise self.error(unknown[0], f"unknown key (expected one of: {expected})")


def _limits(table: _Table, base: TenantLimits) -> TenantLimits:
    limits = TenantLimits(
        fuel=table.get_int("fuel", base.fuel),
        memory_bytes=table.get_size("memory_bytes", base.memory_bytes, minimum=64 * KIB),
        deadline_ms=table.get_int("deadline_ms", base.deadline_ms, minimum=1),
        input_bytes=table.get_size("input_bytes", base.input_bytes, minimum=1),
        output_bytes=table.get_size("output_bytes", base.output_bytes, minimum=1),
        max_concurrency=table.get_int("max_concurrency", base.max_concurrency, minimum=1),
        rate_per_s=table.get_float("rate_per_s", base.rate_per_s),
        burst=table.get_int("burst", base.burst),
        max_running=table.get_int("max_running", base.max_running),
        max_calls=table.get_int("max_calls", base.max_calls, minimum=1),
        unread_bytes=table.get_size("unread_bytes", base.unread_bytes, minimum=64 * KIB),
        request_bytes=table.get_size("request_bytes", base.request_bytes, minimum=64 * KIB),
        instance_cache_bytes=table.get_size(
            "instance_cache_bytes", base.instance_cache_bytes, minimum=0
        ),
    )
    table.finish()
    return limits


def _server(table: _Table) -> ServerSettings:
    base = ServerSettings()
    mode_text = table.get_str("socket_mode", f"{base.socket_mode:04o}")
    try:
        socket_mode = int(mode_text, 8)
    except ValueError:
        message = f'expected an octal mode such as "0600", got {mode_text!r}'
        raise table.error("socket_mode", message) from None
    if socket_mode & ~0o777:
        message = f"expected permission bits only (<= 0777), got {mode_text!r}"
        raise table.error("socket_mode", message)
    listen = table.get_str("listen", base.listen)
    if listen and not listen.startswith("unix:") and ":" not in listen:
        raise table.error("listen", f"expected unix:PATH or HOST:PORT, got {listen!r}")
    data_listen = table.get_str("data_listen", base.data_listen)
    if data_listen and not data_listen.startswith("unix:"):
        message = f"the data path listens on a unix socket only: unix:PATH, got {data_listen!r}"
        raise table.error("data_listen", message)
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
    )
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise table.error("tls_cert", "tls_cert and tls_key must be given together")
    if settings.tls_client_ca and not settings.tls_cert:
        raise table.error("tls_client_ca", "mutual TLS needs tls_cert and tls_key as well")
    if settings.metrics_listen and ":" not in settings.metrics_listen:
        raise table.error("metrics_listen", f"expected HOST:PORT, got {settings.metrics_listen!r}")
    table.finish()
    return settings


def _host(table: _Table) -> HostSettings:
    base = HostSettings()
    settings = HostSettings(
        max_wasm_stack_bytes=table.get_size(
            "max_wasm_stack_bytes", base.max_wasm_stack_bytes, minimum=4 * KIB
        ),
        module_bytes=table.get_size("module_bytes", base.module_bytes, minimum=8),
        epoch_tick_ms=table.get_float("epoch_tick_ms", base.epoch_tick_ms, minimum=0.1),
        isolation=cast(
            IsolationMode, table.get_str("isolation", base.isolation, choices=_ISOLATION_MODES)
        ),
        compile_cache=table.get_bool("compile_cache", base.compile_cache),
        cache_dir=table.get_str("cache_dir", base.cache_dir),
        load_fuel=table.get_int("load_fuel", base.load_fuel),
        load_deadline_ms=table.get_int("load_deadline_ms", base.load_deadline_ms, minimum=1),
        allocator=cast(
            AllocatorKind, table.get_str("allocator", base.allocator, choices=_ALLOCATORS)
        ),
        pool_instances=table.get_int("pool_instances", base.pool_instances, minimum=1),
        pool_memory_bytes=table.get_size(
            "pool_memory_bytes", base.pool_memory_bytes, minimum=64 * KIB
        ),
        instances_per_thread=table.get_int(
            "instances_per_thread", base.instances_per_thread, minimum=1
        ),
    )
    table.finish()
    return settings


_HASH_HELP = "expected 64 hex digits (the SHA-256 of the token; make one with `evald hash-token`)"


def is_tenant_name(name: str) -> bool:
    """Whether ``name`` is a valid tenant name (``[a-z][a-z0-9_-]{0,63}``)."""
    return _TENANT_NAME.fullmatch(name) is not None


def _tenant(table: _Table, default_limits: TenantLimits) -> TenantConfig:
    name = table.get_str("name", "")
    if not is_tenant_name(name):
        raise table.error("name", f"expected a name matching [a-z][a-z0-9_-]{{0,63}}, got {name!r}")
    one = table.get_str("token_sha256", "").lower()
    hashes = tuple(value.lower() for value in table.get_str_list("token_sha256s", ()))
    if one and not _SHA256_HEX.fullmatch(one):
        raise table.error("token_sha256", _HASH_HELP)
    for value in hashes:
        if not _SHA256_HEX.fullmatch(value):
            raise table.error("token_sha256s", _HASH_HELP)
    evaluators = table.get_str_list("evaluators", ())
    for evaluator in evaluators:
        if evaluator != "*" and evaluator not in STANDARD_EVALUATORS:
            raise table.error(
                "evaluators",
                f"{evaluator!r} is not a standard evaluator "
                f'(expected "*" or some of: {", ".join(STANDARD_EVALUATORS)}); '
                "a tenant's own modules need not be listed",
            )
    tenant = TenantConfig(
        name=name,
        token_sha256s=tuple(dict.fromkeys((one, *hashes) if one else hashes)),
        limits=_limits(table.get_table("limits"), default_limits),
        evaluators=evaluators,
        allow_register=table.get_bool("allow_register", False),
        max_modules=table.get_int("max_modules", 16),
    )
    table.finish()
    return tenant


def tenant_from_store(
    document: Mapping[str, Any], default_limits: TenantLimits, source: str
) -> TenantConfig:
    """A fleet store's tenant row (name, token hashes, limits that differ from the defaults,
    evaluators, may-register, max modules), checked as a config's tenant is.

    Raises:
        ConfigError: a value of the wrong type or range (the message names ``source``).
    """
    table = _Table(
        {
            "name": document.get("name", ""),
            "token_sha256s": list(document.get("token_sha256s") or []),
            "evaluators": list(document.get("evaluators") or []),
            "allow_register": bool(document.get("may_register", False)),
            "max_modules": document.get("max_modules", 16),
            "limits": dict(document.get("limits") or {}),
        },
        "",
        source,
    )
    return replace(_tenant(table, default_limits), source="store")


def parse_limits(overrides: Mapping[str, Any], base: TenantLimits, source: str) -> TenantLimits:
    """``base`` with ``overrides`` (``[tenants.limits]`` keys) applied, checked.

    Raises:
        ConfigError: an unknown key or a bad value (the message names ``source``).
    """
    return _limits(_Table(dict(overrides), "limits", source), base)


def check_store_url(url: str, where: str = "store.url") -> None:
    """Refuses a store URL that is not ``postgresql://`` or that carries a password (the
    message never echoes the URL).

    Raises:
        ConfigError: saying what to change.
    """
    if not url:
        return
    scheme = url.partition("://")[0]
    if scheme not in ("postgresql", "postgres"):
        raise ConfigError(f"{where}: expected a postgresql:// URL (or nothing: the embedded store)")
    userinfo = url.partition("://")[2].partition("/")[0].partition("@")
    if (userinfo[1] and ":" in userinfo[0]) or "password=" in url.lower():
        raise ConfigError(
            f"{where}: the URL carries a password; put it in a file (store.password_file, "
            "--password-file) or the environment (store.password_env, PGPASSWORD) instead"
        )


def _store(table: _Table) -> StoreSettings:
    base = StoreSettings()
    url = table.get_str("url", base.url)
    try:
        check_store_url(url)
    except ConfigError as exc:
        raise ConfigError(f"{table.source}: {exc}") from None
    settings = StoreSettings(
        url=url,
        password_file=table.get_str("password_file", base.password_file),
        password_env=table.get_str("password_env", base.password_env),
        poll_s=table.get_float("poll_s", base.poll_s, minimum=0.1),
        connect_timeout_s=table.get_float("connect_timeout_s", base.connect_timeout_s, minimum=0.1),
        max_stale_s=table.get_float("max_stale_s", base.max_stale_s),
    )
    if (settings.password_file or settings.password_env) and not url:
        raise table.error("password_file", "a password needs store.url (the fleet store)")
    table.finish()
    return settings


def parse_config(text: str, source: str = "<string>") -> Config:
    """Parses and validates a config.

    Raises:
        ConfigError: invalid TOML, an unknown key, a value of the wrong type or range, or an
            inconsistent set of tenants. The message names the file and the key.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    root = _Table(data, "", source)
    server = _server(root.get_table("server"))
    host = _host(root.get_table("host"))
    store = _store(root.get_table("store"))
    defaults = root.get_table("defaults")
    default_limits = _limits(defaults.get_table("limits"), TenantLimits())
    defaults.finish()
    tenant_tables = root.get_tables("tenants")
    root.finish()
    tenants = tuple(_tenant(table, default_limits) for table in tenant_tables)

    names: set[str] = set()
    hashes: set[str] = set()
    tokenless = [tenant.name for tenant in tenants if tenant.tokenless]
    for index, tenant in enumerate(tenants):
        if tenant.name in names:
            raise ConfigError(f"{source}: tenants[{index}].name: duplicate tenant {tenant.name!r}")
        names.add(tenant.name)
        for token_sha256 in tenant.token_sha256s:
            if token_sha256 in hashes:
                raise ConfigError(
                    f"{source}: tenants[{index}].token_sha256: "
                    "the same token is given to two tenants"
                )
            hashes.add(token_sha256)
    if len(tokenless) > 1:
        raise ConfigError(
            f"{source}: tenants: at most one tenant may have no token_sha256 (the unix-socket "
            f"tenant); found {', '.join(tokenless)}"
        )
    return Config(
        server=server,
        host=host,
        default_limits=default_limits,
        tenants=tenants,
        source=source,
        store=store,
    )


def load_config(path: Path | str | None = None) -> Config:
    """Loads ``path``, or ``$EVALD_CONFIG``, or the packaged default config.

    Raises:
        ConfigError: the file cannot be read or is invalid.
    """
    if path is None:
        env = os.environ.get("EVALD_CONFIG", "").strip()
        path = Path(env) if env else DEFAULT_CONFIG_PATH
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: the config is not UTF-8 text") from None
    return parse_config(text, str(path))
