"""The host's two configuration records: per-call limits and engine-wide settings.

Both are frozen dataclasses so one value can be shared by threads and used as a cache key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["HostConfig", "Limits"]


@dataclass(frozen=True)
class Limits:
    """What one evaluation may use; set per tenant, applied per call.

    Attributes:
        fuel: wasm fuel per evaluation (about one unit per instruction); 0 disables metering
            (tests only: the epoch deadline still stops the guest).
        memory_bytes: the cap on the guest's linear memory; ``memory.grow`` past it fails.
        deadline_ms: wall-clock budget per evaluation, enforced by epoch interruption.
        input_bytes: a longer input is refused with ``input_too_large``; the guest is not called.
        output_bytes: a longer value (or error payload) is ``output_too_large``.
        instance_cache_bytes: in ``reuse`` mode, the linear memory that the instances kept for
            this caller's pool key (the daemon: the tenant) may hold, every worker thread
            together; past it the least recently used go (docs/design.md §5).
    """

    fuel: int = 200_000_000
    memory_bytes: int = 64 * 2**20
    deadline_ms: int = 100
    input_bytes: int = 1 * 2**20
    output_bytes: int = 64 * 2**10
    instance_cache_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        for name in (
            "fuel",
            "memory_bytes",
            "deadline_ms",
            "input_bytes",
            "output_bytes",
            "instance_cache_bytes",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"Limits.{name} must be a non-negative int, not {value!r}")
        if self.deadline_ms == 0:
            raise ValueError("Limits.deadline_ms must be at least 1")
        if self.fuel >= 2**63:
            raise ValueError("Limits.fuel must be below 2**63 (use 0 for unmetered)")


@dataclass(frozen=True)
class HostConfig:
    """Settings of the wasm engine, shared by every tenant of one host.

    Attributes:
        max_wasm_stack_bytes: native stack available to wasm code (recursion depth cap).
        module_bytes: the module size cap.
        epoch_tick_ms: period of the epoch ticker thread; deadlines are counted in these ticks.
            0 disables the thread (tests advance the epoch by hand with
            :meth:`evald.host.WasmHost.advance_epoch`; a tick then counts as 1 ms).
        isolation: ``fresh`` (the default) starts every call from a new instance's state: the
            instance kept per (thread, pool key, module) is put back after each call (every
            page the call wrote, every global, the memory size the guest sees), or, for a module
            that cannot be put back, a new instance is made for the call. ``reuse`` keeps the
            instance as the last call left it and zeroes only its buffers: a little faster, but
            what one call leaves in the guest's heap or globals the next call of the same pool
            key sees (docs/daemon.md, "Isolation").
        cache_dir: where compiled modules (``.cwasm``) are kept; None disables the disk cache.
            The directory must be private to the daemon (a cached file is native code).
        load_fuel, load_deadline_ms: the budget of the trial instantiation at load.
        allocator: ``auto`` uses wasmtime's pooling allocator in fresh mode and the default
            allocator in reuse mode; ``pooling`` / ``default`` force one.
        pool_instances: pooling allocator slots (instances alive at once, all threads).
        pool_memory_bytes: per-slot memory reservation of the pooling allocator; also an upper
            bound on any tenant's memory cap in pooling mode.
        instances_per_thread: at most this many instances are kept per thread, in either mode
            (least recently used are dropped); ``Limits.instance_cache_bytes`` bounds their
            memory.
        signals_based_traps: let wasmtime catch out-of-bounds accesses with guard pages and a
            SIGSEGV handler instead of explicit bounds checks. Off by default: a library that
            installs its own SIGSEGV handler later in the process (``tvm_ffi``, imported by
            XGrammar, does) turns every out-of-bounds guest access into a process crash.
    """

    max_wasm_stack_bytes: int = 256 * 2**10
    module_bytes: int = 4 * 2**20
    epoch_tick_ms: float = 1.0
    isolation: Literal["reuse", "fresh"] = "fresh"
    cache_dir: Path | None = None
    load_fuel: int = 50_000_000
    load_deadline_ms: int = 2000
    allocator: Literal["auto", "pooling", "default"] = "auto"
    pool_instances: int = 256
    pool_memory_bytes: int = 256 * 2**20
    instances_per_thread: int = 64
    signals_based_traps: bool = False

    def __post_init__(self) -> None:
        if self.isolation not in ("reuse", "fresh"):
            raise ValueError(
                f"HostConfig.isolation must be 'reuse' or 'fresh', not {self.isolation!r}"
            )
        if self.allocator not in ("auto", "pooling", "default"):
            raise ValueError(
                f"HostConfig.allocator must be auto, pooling or default, not {self.allocator!r}"
            )
        if self.epoch_tick_ms < 0:
            raise ValueError("HostConfig.epoch_tick_ms must be >= 0")
        for name in (
            "max_wasm_stack_bytes",
            "module_bytes",
            "load_fuel",
            "load_deadline_ms",
            "pool_instances",
            "pool_memory_bytes",
            "instances_per_thread",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"HostConfig.{name} must be positive")

    @property
    def pooling(self) -> bool:
        """Whether instances come from the pooling allocator."""
        if self.allocator == "auto":
            return self.isolation == "fresh"
        return self.allocator == "pooling"
