"""The ``[host]`` table: the wasm host's engine-wide settings (``evald.host.HostConfig``).

Why apart: its defaults are the host's own (:class:`evald.host.HostConfig`, their one home);
this module only reads the table and checks each key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

from evald.daemon._config_table import KIB, ConfigTable
from evald.host import HostConfig

__all__ = ["AllocatorKind", "HostSettings", "IsolationMode", "host_from_table"]

_ISOLATION_MODES = ("reuse", "fresh")
_ALLOCATORS = ("auto", "pooling", "default")

#: The one home of every engine default (``evald/host/_limits.py``).
_HOST = HostConfig()

IsolationMode = Literal["reuse", "fresh"]
AllocatorKind = Literal["auto", "pooling", "default"]


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


def host_from_table(table: ConfigTable) -> HostSettings:
    """The ``[host]`` table, each key checked.

    Raises:
        ConfigError: an unknown key or a bad value (the message names the key).
    """
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
