"""The WebAssembly host: loads evaluator modules and runs them under per-tenant limits.

"Compile once, instantiate many": :meth:`WasmHost.load` validates a module against ABI v1,
compiles it (through the on-disk cache) and trial-instantiates it under a load budget, giving a
:class:`~evald.host._loaded_module.LoadedModule`; :meth:`WasmHost.evaluate` runs one input
through it and always returns an :class:`~evald.host._outcome.EvalOutcome` — guest errors,
traps and limit hits are values with a typed :class:`~evald.contract.ErrorCode`, never
exceptions.

:class:`WasmHost` is the entry point and the composition root; each seam has a module:

=========================  ===============================================================
``_module_loader.py``      validate → compile or cache → trial instantiation
``_loaded_module.py``      what loading leaves for every call (``LoadedModule``, read-only)
``_instance.py``           one live store and instance, its buffers, the table caps
``_instance_pool.py``      the per-thread kept instances (both modes)
``_call_path.py``          one call: fuel, deadline, input and output buffers, the result
``_deadline.py``           deadlines in epoch ticks, and the ticker thread
``_guest_output.py``       the guest's value or error payload, checked
``_outcome.py``            ``EvalOutcome``; traps as error codes
=========================  ===============================================================

Beneath them: ``_abi.py`` (ABI v1 validation), ``_instrument.py`` (the ``memory.grow``
rewrite), ``_module_cache.py`` (compiled code on disk), ``_compiler.py`` (validation and
compilation in a worker process), ``_engine.py`` (the engine configuration and the epoch
ticker), ``_fastcall.py`` (the raw ctypes calls into wasmtime), ``_memory_reset.py`` (a
linear memory put back to its initial contents, for fresh instances).

How each limit is enforced (docs/design.md §5):

* fuel: the engine consumes fuel; each call gets ``Limits.fuel`` (``OUT_OF_FUEL`` trap).
* deadline: epoch interruption; a ticker thread advances the epoch every ``epoch_tick_ms`` and
  each call gets a deadline of ``deadline_ms`` worth of ticks (``INTERRUPT`` trap). This stops
  a loop even when fuel is not metered.
* memory: ``Store.set_limits(memory_size=...)``; a grow past it returns -1 to the guest. The
  module is rewritten at load (:mod:`evald.host._instrument`) so a refused grow is recorded; a trap
  that follows one is reported as ``memory_limit``.
* stack: ``max_wasm_stack`` (``STACK_OVERFLOW`` trap).
* tables: at most ``MAX_TABLES`` tables of ``MAX_TABLE_ELEMENTS`` elements per store
  (:mod:`evald.host._instance` says why neither fuel nor the memory cap bounds them).
* input / output size: checked by the host before and after the call.

Instances: each thread keeps one instance per (pool key, module) — the daemon passes the tenant
as pool key, so tenants never share an instance; what one key's instances hold, all threads
together, stays within ``Limits.instance_cache_bytes``. In ``fresh`` mode (the default) every
call starts from a new instance's state: the kept instance is put back after the call (every
page the call wrote, by the kernel's account, every global and the guest's memory size;
:class:`Instance.reset <evald.host._instance.Instance>`), and a module that cannot be put back
gets a new instance per call (pre-linked, on the pooling allocator by default). In ``reuse``
mode the instance stays as the call left it, with what crossed the boundary zeroed (the input
written, the output returned; what the guest keeps elsewhere in its memory or its globals
persists). An instance is discarded after any trap (the guest's shadow stack pointer is not
unwound) and after any malformed output.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Final

import wasmtime

from evald.contract import ErrorCode
from evald.host._call_path import CallPath
from evald.host._compiler import CompiledModule
from evald.host._deadline import EpochDeadlines
from evald.host._engine import make_engine_config
from evald.host._instance_pool import InstancePool
from evald.host._limits import HostConfig, Limits
from evald.host._loaded_module import LoadedModule
from evald.host._module_loader import ModuleLoader
from evald.host._outcome import EvalOutcome, Failure, first_line

__all__ = ["WasmHost"]

_log = logging.getLogger("evald.host")

DEFAULT_HOST_CONFIG: Final = HostConfig()
DEFAULT_LIMITS: Final = Limits()


class WasmHost:
    """Runs evaluator modules under limits; thread-safe. See the module docstring."""

    def __init__(self, config: HostConfig = DEFAULT_HOST_CONFIG) -> None:
        self.config = config
        self._pooling = config.pooling
        self._engine = wasmtime.Engine(make_engine_config(config, pooling=self._pooling))
        self._deadlines = EpochDeadlines(self._engine, config.epoch_tick_ms)
        self._ticker = self._deadlines.ticker
        if self._ticker is not None:
            # a host dropped without close() must not leave its ticker thread running
            weakref.finalize(self, self._ticker.stop)
        self._loader = ModuleLoader(self._engine, config, self._deadlines)
        self._pool = InstancePool(
            self._engine,
            self._deadlines,
            config.instances_per_thread,
            fresh=config.isolation == "fresh",
        )
        self._call = CallPath(self._engine, config, self._deadlines, self._pool)
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the epoch ticker thread. Evaluations after close return ``unavailable``."""
        self._closed = True
        self._deadlines.stop()
        self._pool.clear()

    def __enter__(self) -> WasmHost:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def advance_epoch(self, ticks: int = 1) -> None:
        """Advances the epoch by hand (with ``epoch_tick_ms=0``, for deterministic tests)."""
        for _ in range(ticks):
            self._engine.increment_epoch()

    @property
    def cache_stats(self) -> tuple[int, int]:
        """(hits, misses) of the compiled-module disk cache."""
        cache = self._loader.cache
        return cache.hits, cache.misses

    # -- loading ---------------------------------------------------------------------------

    def load(self, wasm: bytes, *, limits: Limits = DEFAULT_LIMITS) -> LoadedModule:
        """Validates, compiles and trial-instantiates a module.

        Parameters:
            wasm: the module bytes.
            limits: the limits it will run under; its memory cap must hold the declared
                minimum. Instantiation runs under ``HostConfig.load_fuel`` and
                ``load_deadline_ms``.

        Raises:
            EvaldError: ``INVALID_MODULE`` with an actionable message, for any problem.
        """
        return self._loader.load(bytes(wasm), self.memory_cap(limits))

    def adopt(self, wasm: bytes, compiled: CompiledModule, *, limits: Limits) -> LoadedModule:
        """A module validated and compiled elsewhere (:class:`evald.host.Compiler`,
        registration's worker process), trial-instantiated here under the load budget.

        Nothing is looked up or kept by hash, so the cost does not depend on what was loaded
        before; :meth:`store_compiled` writes the disk cache once the module is accepted.

        Raises:
            EvaldError: ``INVALID_MODULE`` (the code does not load here, or the trial failed).
        """
        return self._loader.adopt(wasm, compiled, self.memory_cap(limits))

    def store_compiled(self, module: LoadedModule) -> None:
        """Writes ``module``'s compiled code to the disk cache (a restart then deserializes)."""
        self._loader.store_compiled(module)

    def discard_code(self, sha256: str) -> None:
        """Drops the compiled code kept for ``sha256``, in memory and on disk, once nothing
        refers to it (the registry decides that)."""
        self._loader.discard_code(sha256)

    def collect_cache(self, keep: set[str]) -> list[str]:
        """Removes cached compiled code of every hash not in ``keep``; returns the files."""
        return self._loader.cache.collect(keep)

    def forget(self, module: LoadedModule) -> None:
        """Drops the compiled code kept for ``module``'s hash and every thread's instances of
        it (after the daemon deletes or replaces it); a call running on one finishes first."""
        self._loader.forget(module.sha256)
        self._pool.forget(module.sha256)

    def cached_bytes(self, pool_key: str) -> int:
        """The linear memory that reuse mode's kept instances of ``pool_key`` hold now, every
        thread together (at most its ``Limits.instance_cache_bytes`` after each call)."""
        return self._pool.held_bytes(pool_key)

    def memory_cap(self, limits: Limits) -> int:
        """The memory cap a module runs under with ``limits`` (the pool slot bounds it); the
        rule's one home is the call path's (:meth:`CallPath.memory_cap
        <evald.host._call_path.CallPath.memory_cap>`)."""
        return self._call.memory_cap(limits)

    # -- evaluation ------------------------------------------------------------------------

    def take_uncharged_s(self) -> float:
        """CPU seconds the calling thread spent since it last asked re-making instances that
        another pool key pushed out of its cache: work a scheduler should not charge to the
        key whose call it was (:meth:`InstancePool.take_uncharged_s
        <evald.host._instance_pool.InstancePool.take_uncharged_s>`)."""
        return self._pool.take_uncharged_s()

    def evaluate(
        self, module: LoadedModule, data: bytes, limits: Limits, *, pool_key: str = ""
    ) -> EvalOutcome:
        """Runs ``module`` on ``data`` under ``limits``; never raises for guest or limit problems.

        Parameters:
            module: from :meth:`load` on this host.
            data: the span content, passed to the guest as is.
            limits: the caller's (tenant's) limits for this call.
            pool_key: reuse mode keeps separate instances per key (the daemon uses the tenant).

        Returns:
            An :class:`EvalOutcome`; ``error`` is set for guest errors, traps and limit hits.
        """
        started = time.perf_counter_ns()
        try:
            if self._closed:
                raise Failure(ErrorCode.UNAVAILABLE, "the wasm host is shut down")
            if type(data) is not bytes:
                data = bytes(data)
            value, fuel_used = self._call.run(module, data, limits, pool_key)
            return EvalOutcome(
                value, None, "", fuel_used, (time.perf_counter_ns() - started) // 1000
            )
        except Failure as failure:
            return EvalOutcome(
                None,
                failure.code,
                failure.message,
                failure.fuel_used,
                (time.perf_counter_ns() - started) // 1000,
            )
        except Exception as exc:  # a host bug must not take the daemon down
            _log.exception("evaluation of %s failed inside the host", module)
            return EvalOutcome(
                None,
                ErrorCode.INTERNAL,
                f"internal error in the wasm host: {first_line(exc)}",
                0,
                (time.perf_counter_ns() - started) // 1000,
            )
