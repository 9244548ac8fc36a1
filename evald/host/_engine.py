"""The wasmtime engine the host runs guests in, and the thread that drives its epoch.

One configuration decides what a guest may use and how it is stopped:

* ``consume_fuel``: every instruction costs fuel; a store runs out -> ``OUT_OF_FUEL`` trap.
* ``epoch_interruption``: compiled code checks the engine epoch at loop heads and function
  entries; :class:`EpochTicker` increments it every ``epoch_tick_ms`` from a native thread
  (``evald/host/_epoch.c``) that never waits for the GIL, so a Python thread holding it cannot
  delay a deadline. Every store must get a deadline before each call: an unset one traps at
  once.
* ``max_wasm_stack``: the recursion cap (``STACK_OVERFLOW`` trap).
* no signal handlers by default (``signals_based_traps``): bounds are checked in the compiled
  code, so the host keeps working when another library in the process replaces the SIGSEGV
  handler (``tvm_ffi``, under XGrammar, does; wasmtime's handler is then gone and an
  out-of-bounds guest access would crash the process).
* Proposals a pure evaluator has no use for (threads, GC, exceptions, memory64, multiple
  memories, tail calls, the component model, …) are off: less attack surface, and a smaller
  instruction set for :mod:`evald.host._instrument` to read.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import json
import logging
import platform
import threading
import time
from typing import Any

import wasmtime
from wasmtime import _ffi as ffi

from evald.host._instance import MAX_TABLE_ELEMENTS, MAX_TABLES
from evald.host._instrument import INSTRUMENTATION_VERSION
from evald.host._limits import HostConfig

__all__ = ["EpochTicker", "engine_fingerprint", "make_engine_config", "wasmtime_version"]

_log = logging.getLogger("evald.host")

_NATIVE_MISSING = ""
try:
    from evald.host import _epoch

    _NATIVE: Any = _epoch
except ImportError as exc:  # not built (no C compiler at install): the Python thread
    _NATIVE = None
    _NATIVE_MISSING = str(exc)

_DISABLED_PROPOSALS = (
    "wasm_threads",
    "wasm_gc",
    "wasm_function_references",
    "wasm_exceptions",
    "wasm_memory64",
    "wasm_multi_memory",
    "wasm_component_model",
    "wasm_stack_switching",
    "wasm_relaxed_simd",
    "wasm_tail_call",
    "wasm_custom_page_sizes",
    "wasm_wide_arithmetic",
)


def wasmtime_version() -> str:
    """The installed wasmtime-py version (compiled modules are only valid for the same one)."""
    return importlib.metadata.version("wasmtime")


def _settings(config: HostConfig, pooling: bool) -> dict[str, object]:
    return {
        "consume_fuel": True,
        "epoch_interruption": True,
        "max_wasm_stack": config.max_wasm_stack_bytes,
        "disabled": list(_DISABLED_PROPOSALS),
        "pooling": pooling,
        "signals_based_traps": config.signals_based_traps,
        "pool_instances": config.pool_instances if pooling else None,
        "pool_memory_bytes": config.pool_memory_bytes if pooling else None,
        "pool_tables": [MAX_TABLES, MAX_TABLE_ELEMENTS] if pooling else None,
    }


def make_engine_config(config: HostConfig, *, pooling: bool) -> wasmtime.Config:
    """A fresh ``wasmtime.Config`` for ``config`` (an engine consumes it)."""
    engine_config = wasmtime.Config()
    engine_config.consume_fuel = True
    engine_config.epoch_interruption = True
    engine_config.max_wasm_stack = config.max_wasm_stack_bytes
    for proposal in _DISABLED_PROPOSALS:
        setattr(engine_config, proposal, False)
    ffi.wasmtime_config_signals_based_traps_set(engine_config.ptr(), config.signals_based_traps)
    if pooling:
        pool = ffi.wasmtime_pooling_allocation_config_new()
        try:
            slots = config.pool_instances
            ffi.wasmtime_pooling_allocation_config_total_core_instances_set(pool, slots)
            ffi.wasmtime_pooling_allocation_config_total_memories_set(pool, slots)
            # the store caps (evald.host._instance) hold in the pool too: up to MAX_TABLES
            # tables of MAX_TABLE_ELEMENTS per instance, one table per slot on average (the
            # table pool is mapped up front: slots x 512 KiB of address space)
            ffi.wasmtime_pooling_allocation_config_total_tables_set(pool, slots)
            ffi.wasmtime_pooling_allocation_config_max_tables_per_module_set(pool, MAX_TABLES)
            ffi.wasmtime_pooling_allocation_config_table_elements_set(pool, MAX_TABLE_ELEMENTS)
            ffi.wasmtime_pooling_allocation_config_total_stacks_set(pool, 0)
            ffi.wasmtime_pooling_allocation_config_total_component_instances_set(pool, 0)
            ffi.wasmtime_pooling_allocation_config_total_gc_heaps_set(pool, 0)
            ffi.wasmtime_pooling_allocation_config_max_memory_size_set(
                pool, config.pool_memory_bytes
            )
            ffi.wasmtime_pooling_allocation_config_max_memories_per_module_set(pool, 1)
            ffi.wasmtime_pooling_allocation_strategy_set(engine_config.ptr(), pool)
        finally:
            ffi.wasmtime_pooling_allocation_config_delete(pool)
    return engine_config


def engine_fingerprint(config: HostConfig, *, pooling: bool) -> str:
    """A short hash of everything that makes a compiled module valid for an engine."""
    key = {
        "wasmtime": wasmtime_version(),
        "machine": platform.machine(),
        "instrumentation": INSTRUMENTATION_VERSION,
        **_settings(config, pooling),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


class EpochTicker:
    """Increments an engine's epoch every ``tick_ms`` of wall-clock time.

    Normally a native thread (``evald/host/_epoch.c``) calls wasmtime's
    ``wasmtime_engine_increment_epoch`` on an absolute schedule without ever taking the GIL.
    Where the extension was not built, a Python thread does it (logged once as a warning):
    it then wakes only when it gets the GIL, so a thread that holds the GIL delays deadlines.

    Either way a late wake-up catches up (several increments at once) so the epoch tracks the
    wall clock, and a call's deadline must be set past the current lag (:meth:`lag_ticks`), or
    a catch-up burst would end it early.
    """

    _warned = False

    def __init__(
        self, engine: wasmtime.Engine, tick_ms: float, *, native: bool | None = None
    ) -> None:
        self._engine = engine
        self._tick_s = tick_ms / 1000.0
        self._start = time.monotonic()
        self._done = 0  # increments made; read by other threads (an int read is atomic)
        self._stop = threading.Event()
        self._native: Any = None
        self._thread: threading.Thread | None = None
        use_native = _NATIVE is not None if native is None else native
        if use_native and _NATIVE is None:
            raise RuntimeError(f"the native epoch ticker is not available: {_NATIVE_MISSING}")
        if use_native:
            increment = ctypes.cast(ffi.dll.wasmtime_engine_increment_epoch, ctypes.c_void_p)
            address = ctypes.cast(engine.ptr(), ctypes.c_void_p)
            self._native = _NATIVE.Ticker(
                increment.value, address.value, max(1, round(tick_ms * 1_000_000))
            )
            return
        if not EpochTicker._warned and _NATIVE is None:
            EpochTicker._warned = True
            _log.warning(
                "the native epoch ticker (evald.host._epoch) is not built; using a Python thread, "
                "so deadlines depend on the GIL (reinstall evald with a C compiler present)",
                extra={"fields": {"error": _NATIVE_MISSING}},
            )
        self._thread = threading.Thread(target=self._run, name="evald-epoch-ticker", daemon=True)
        self._thread.start()

    @property
    def native(self) -> bool:
        """Whether the ticker is the GIL-free native thread."""
        return self._native is not None

    def _due(self) -> int:
        return int((time.monotonic() - self._start) / self._tick_s)

    def lag_ticks(self) -> int:
        """How many ticks the engine epoch is behind the wall clock right now."""
        if self._native is not None:
            return int(self._native.lag_ticks())
        return max(0, self._due() - self._done)

    def _run(self) -> None:
        while not self._stop.wait(self._tick_s):
            for _ in range(min(self._due() - self._done, 10_000)):
                self._engine.increment_epoch()
                self._done += 1

    def stop(self) -> None:
        """Stops the thread and waits for it (idempotent)."""
        if self._native is not None:
            self._native.stop()
            return
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=5)
