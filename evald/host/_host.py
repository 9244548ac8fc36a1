"""The WebAssembly host: loads evaluator modules and runs them under per-tenant limits.

"Compile once, instantiate many": :meth:`WasmHost.load` validates a module against ABI v1
(:mod:`evald.host._abi`), compiles it (through the on-disk cache) and trial-instantiates it under a
load budget, giving a :class:`LoadedModule`; :meth:`WasmHost.evaluate` runs one input through
it and always returns an :class:`EvalOutcome` — guest errors, traps and limit hits are values
with a typed :class:`~evald.contract.ErrorCode`, never exceptions.

How each limit is enforced (docs/design.md §5):

* fuel: the engine consumes fuel; each call gets ``Limits.fuel`` (``OUT_OF_FUEL`` trap).
* deadline: epoch interruption; a ticker thread advances the epoch every ``epoch_tick_ms`` and
  each call gets a deadline of ``deadline_ms`` worth of ticks (``INTERRUPT`` trap). This stops
  a loop even when fuel is not metered.
* memory: ``Store.set_limits(memory_size=...)``; a grow past it returns -1 to the guest. The
  module is rewritten at load (:mod:`evald.host._instrument`) so a refused grow is recorded; a trap
  that follows one is reported as ``memory_limit``.
* stack: ``max_wasm_stack`` (``STACK_OVERFLOW`` trap).
* tables: at most ``MAX_TABLES`` tables of ``MAX_TABLE_ELEMENTS`` elements per store. Tables
  live outside linear memory, so the memory cap does not bound them, and one ``table.fill`` or
  ``table.grow`` is a single instruction that neither fuel nor the epoch interrupts: without
  this cap a guest could commit gigabytes and run for seconds past its deadline in one call.
* input / output size: checked by the host before and after the call.

Instances: in ``reuse`` mode each thread keeps one instance per (pool key, module) — the daemon
passes the tenant as pool key, so tenants never share an instance — and after every call zeroes
what crossed the boundary (the input written, the output returned; what the guest keeps
elsewhere in its memory persists, as any guest state does); in ``fresh`` mode each call gets a
new store and instance (wasmtime's pooling allocator by default) and shares nothing. An instance
is discarded after any trap (the guest's shadow stack pointer is not unwound) and after any
malformed output.

Calls go through :mod:`evald.host._fastcall`, which releases the GIL: the daemon runs evaluations
on worker threads, several at once. A reused instance's call is lean, because at a few
microseconds every foreign call shows: the input, output and zeroing go through a byte view of
the guest memory (no foreign call, taken again only when a call grew the memory), and a call makes
five foreign calls in all (fuel set and read, epoch deadline, the guest call, the memory size).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
import weakref
from collections import OrderedDict
from typing import Final, NamedTuple

import wasmtime

from evald.contract import GUEST_ERROR_CODES, ErrorCode, EvaldError
from evald.host import _fastcall as fast
from evald.host._abi import (
    ABI_VERSION,
    BUFFER_EXPORTS,
    EVAL_EXPORT,
    VERSION_EXPORT,
    WASM_PAGE_BYTES,
    Manifest,
    inspect_module,
)
from evald.host._compiler import CompiledModule
from evald.host._engine import EpochTicker, engine_fingerprint, make_engine_config
from evald.host._instrument import EVAL_WRAPPER_EXPORT, GROW_FLAG_EXPORT, instrument_memory_grow
from evald.host._limits import HostConfig, Limits
from evald.host._module_cache import ModuleCache

__all__ = ["EvalOutcome", "HostConfig", "Limits", "LoadedModule", "Manifest", "WasmHost"]

_log = logging.getLogger("evald.host")

#: Fuel given to a call when ``Limits.fuel == 0`` (not metered): more than any deadline allows.
_UNMETERED_FUEL: Final = 2**63 - 1
_MAX_MESSAGE_CHARS: Final = 1000
#: Table caps per store (see the module docstring); an evaluator needs one small function table.
MAX_TABLES: Final = 4
MAX_TABLE_ELEMENTS: Final = 65_536
_GUEST_CODES: Final = {code.value: code for code in GUEST_ERROR_CODES}
#: Zeroes copied over the buffers after a reused call; grown (replaced) when a call needs more.
_zeros = memoryview(bytes(4096))
DEFAULT_HOST_CONFIG: Final = HostConfig()
DEFAULT_LIMITS: Final = Limits()


class EvalOutcome(NamedTuple):
    """The result of one evaluation (immutable; a named tuple because one is made per call and
    a tuple costs a third of a frozen dataclass).

    Attributes:
        value: the UTF-8 value on success, else None.
        error: the error code on failure, else None.
        message: on failure, a sentence a person can act on ("" on success).
        fuel_used: fuel the guest's ``evald_eval`` consumed (0 when it was not called).
        elapsed_us: wall-clock time of the whole evaluation in the host, microseconds.
    """

    value: str | None
    error: ErrorCode | None
    message: str
    fuel_used: int
    elapsed_us: int

    @property
    def ok(self) -> bool:
        return self.error is None


class LoadedModule:
    """A validated, compiled module; cheap to instantiate, shared by all threads.

    Attributes:
        manifest: the module's manifest.
        sha256: hex SHA-256 of the module bytes as uploaded (its identity).
        size_bytes: size of the module as uploaded.
        input_cap, output_cap: the guest's buffer capacities, read at trial instantiation.
        from_cache: the compiled code came from the disk cache.
        grow_observed: the host can tell a refused ``memory.grow`` (the module was rewritten).
    """

    __slots__ = (
        "_eval_export",
        "_flag_export",
        "_input_ptr",
        "_minimum_memory_bytes",
        "_module",
        "_output_ptr",
        "from_cache",
        "grow_observed",
        "input_cap",
        "manifest",
        "output_cap",
        "sha256",
        "size_bytes",
    )

    def __init__(
        self,
        *,
        manifest: Manifest,
        sha256: str,
        size_bytes: int,
        module: wasmtime.Module,
        grow_observed: bool,
        minimum_memory_bytes: int,
        input_cap: int,
        output_cap: int,
        from_cache: bool,
    ) -> None:
        self.manifest = manifest
        self.sha256 = sha256
        self.size_bytes = size_bytes
        self.input_cap = input_cap
        self.output_cap = output_cap
        self.from_cache = from_cache
        self.grow_observed = grow_observed
        self._module = module
        self._eval_export = EVAL_WRAPPER_EXPORT if grow_observed else EVAL_EXPORT
        self._flag_export = GROW_FLAG_EXPORT if grow_observed else None
        self._minimum_memory_bytes = minimum_memory_bytes
        self._input_ptr = self._output_ptr = 0  # set by the trial instantiation

    def __repr__(self) -> str:
        return (
            f"LoadedModule({self.manifest.name} {self.manifest.version}, "
            f"sha256={self.sha256[:12]}, {self.size_bytes} bytes)"
        )


class _Failure(Exception):
    """Internal: ends an evaluation with an error outcome."""

    def __init__(self, code: ErrorCode, message: str, fuel_used: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fuel_used = fuel_used


class _Instance:
    """One live instance with its raw call bindings; used by one thread only."""

    __slots__ = (
        "context",
        "eval",
        "flag",
        "in_cap",
        "in_ptr",
        "memory",
        "memory_cap",
        "module",
        "out_cap",
        "out_ptr",
        "store",
        "view",
        "view_size",
    )

    def __init__(self, module: LoadedModule, store: wasmtime.Store, memory_cap: int) -> None:
        self.module = module
        self.store = store
        self.context = fast.RawStore(store)
        self.memory_cap = memory_cap
        self.in_ptr = self.in_cap = self.out_ptr = self.out_cap = 0
        self.eval: fast.RawFunc
        self.memory: fast.RawMemory
        self.flag: wasmtime.Global | None = None
        self.view = memoryview(bytearray())
        self.view_size = 0

    def refresh_view(self) -> None:
        """Takes a new view of the memory (after instantiation, or a call that grew it)."""
        self.view = self.memory.view()
        self.view_size = len(self.view)

    def grow_was_refused(self) -> bool:
        if self.flag is None:
            return False
        try:
            return bool(self.flag.value(self.store))
        except wasmtime.WasmtimeError:
            return False


def _zero_source(length: int) -> memoryview:
    """``length`` zero bytes to copy from (a view: no allocation per call)."""
    global _zeros
    zeros = _zeros
    if len(zeros) < length:
        zeros = _zeros = memoryview(bytes(max(length, 2 * len(zeros))))
    return zeros[:length]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _trap_name(trap: wasmtime.Trap) -> str:
    code = trap.trap_code
    return code.name.lower().replace("_", " ") if code is not None else "unknown trap"


class WasmHost:
    """Runs evaluator modules under limits; thread-safe. See the module docstring."""

    def __init__(self, config: HostConfig = DEFAULT_HOST_CONFIG) -> None:
        self.config = config
        self._pooling = config.pooling
        self._engine = wasmtime.Engine(make_engine_config(config, pooling=self._pooling))
        self._cache = ModuleCache(
            config.cache_dir, self._engine, engine_fingerprint(config, pooling=self._pooling)
        )
        self._tick_ms = config.epoch_tick_ms if config.epoch_tick_ms > 0 else 1.0
        self._fresh = config.isolation == "fresh"
        self._deadline_ticks: dict[int, int] = {}
        self._ticker = (
            EpochTicker(self._engine, config.epoch_tick_ms) if config.epoch_tick_ms > 0 else None
        )
        if self._ticker is not None:
            # a host dropped without close() must not leave its ticker thread running
            weakref.finalize(self, self._ticker.stop)
        self._local = threading.local()
        self._compiled: dict[str, tuple[wasmtime.Module, bool, bool]] = {}
        self._compile_lock = threading.Lock()
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the epoch ticker thread. Evaluations after close return ``unavailable``."""
        self._closed = True
        if self._ticker is not None:
            self._ticker.stop()
        self._thread_instances().clear()

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
        return self._cache.hits, self._cache.misses

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
        wasm = bytes(wasm)
        memory_cap = self._memory_cap(limits)
        manifest, info = inspect_module(
            wasm,
            max_module_bytes=self.config.module_bytes,
            max_memory_bytes=memory_cap,
            engine=self._engine,
        )
        sha256 = hashlib.sha256(wasm).hexdigest()
        eval_index = next(e.index for e in info.exports if e.name == EVAL_EXPORT)
        with self._compile_lock:
            known = self._compiled.get(sha256)
        if known is None:

            def compile_module() -> wasmtime.Module:
                try:
                    code = instrument_memory_grow(wasm, info, eval_index) or wasm
                except Exception:  # the rewrite is an aid; never let it refuse a valid module
                    _log.exception("cannot rewrite memory.grow in %s; running it as is", sha256)
                    code = wasm
                try:
                    return wasmtime.Module(self._engine, code)
                except wasmtime.WasmtimeError as exc:
                    raise EvaldError(
                        ErrorCode.INVALID_MODULE,
                        f"wasmtime cannot compile the module: {_first_line(exc)}",
                    ) from exc

            compiled, from_cache = self._cache.load(sha256, compile_module)
            grow_observed = any(e.name == GROW_FLAG_EXPORT for e in compiled.exports)
            known = (compiled, grow_observed, from_cache)
            with self._compile_lock:
                self._compiled[sha256] = known
        compiled, grow_observed, from_cache = known
        return self._trial_load(
            manifest,
            sha256,
            len(wasm),
            compiled,
            grow_observed=grow_observed,
            minimum_memory_bytes=info.memories[0].minimum_pages * WASM_PAGE_BYTES,
            from_cache=from_cache,
            memory_cap=memory_cap,
        )

    def adopt(self, wasm: bytes, compiled: CompiledModule, *, limits: Limits) -> LoadedModule:
        """A module validated and compiled elsewhere (:mod:`evald.host._compiler`, registration's
        worker process), trial-instantiated here under the load budget.

        Nothing is looked up or kept by hash, so the cost does not depend on what was loaded
        before; :meth:`store_compiled` writes the disk cache once the module is accepted.

        Raises:
            EvaldError: ``INVALID_MODULE`` (the code does not load here, or the trial failed).
        """
        try:
            module = wasmtime.Module.deserialize(self._engine, compiled.code)
        except wasmtime.WasmtimeError as exc:
            raise EvaldError(
                ErrorCode.INVALID_MODULE, f"the compiled module does not load: {_first_line(exc)}"
            ) from exc
        return self._trial_load(
            compiled.manifest,
            hashlib.sha256(wasm).hexdigest(),
            len(wasm),
            module,
            grow_observed=compiled.grow_observed,
            minimum_memory_bytes=compiled.minimum_memory_bytes,
            from_cache=False,
            memory_cap=self._memory_cap(limits),
        )

    def store_compiled(self, module: LoadedModule) -> None:
        """Writes ``module``'s compiled code to the disk cache (a restart then deserializes)."""
        self._cache.store(module.sha256, module._module)

    def discard_code(self, sha256: str) -> None:
        """Drops the compiled code kept for ``sha256``, in memory and on disk, once nothing
        refers to it (the registry decides that)."""
        with self._compile_lock:
            self._compiled.pop(sha256, None)
        self._cache.remove(sha256)

    def collect_cache(self, keep: set[str]) -> list[str]:
        """Removes cached compiled code of every hash not in ``keep``; returns the files."""
        return self._cache.collect(keep)

    def _trial_load(
        self,
        manifest: Manifest,
        sha256: str,
        size_bytes: int,
        compiled: wasmtime.Module,
        *,
        grow_observed: bool,
        minimum_memory_bytes: int,
        from_cache: bool,
        memory_cap: int,
    ) -> LoadedModule:
        loaded = LoadedModule(
            manifest=manifest,
            sha256=sha256,
            size_bytes=size_bytes,
            module=compiled,
            grow_observed=grow_observed,
            minimum_memory_bytes=minimum_memory_bytes,
            input_cap=0,
            output_cap=0,
            from_cache=from_cache,
        )
        try:
            instance = self._instantiate(
                loaded,
                memory_cap,
                self.config.load_fuel,
                self._ticks(self.config.load_deadline_ms),
                trial=True,
            )
        except _Failure as failure:
            raise EvaldError(
                ErrorCode.INVALID_MODULE, f"trial instantiation failed: {failure.message}"
            ) from None
        loaded.input_cap, loaded.output_cap = instance.in_cap, instance.out_cap
        loaded._input_ptr, loaded._output_ptr = instance.in_ptr, instance.out_ptr
        return loaded

    def forget(self, module: LoadedModule) -> None:
        """Drops the compiled code kept for ``module``'s hash (after the daemon deletes it).

        Instances already made by other threads are released as their LRU turns over.
        """
        with self._compile_lock:
            self._compiled.pop(module.sha256, None)
        instances = self._thread_instances()
        for key in [k for k in instances if k[1] == module.sha256]:
            del instances[key]

    # -- evaluation ------------------------------------------------------------------------

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
                raise _Failure(ErrorCode.UNAVAILABLE, "the wasm host is shut down")
            if type(data) is not bytes:
                data = bytes(data)
            value, fuel_used = self._evaluate(module, data, limits, pool_key)
            return EvalOutcome(
                value, None, "", fuel_used, (time.perf_counter_ns() - started) // 1000
            )
        except _Failure as failure:
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
                f"internal error in the wasm host: {_first_line(exc)}",
                0,
                (time.perf_counter_ns() - started) // 1000,
            )

    def _evaluate(
        self, module: LoadedModule, data: bytes, limits: Limits, pool_key: str
    ) -> tuple[str, int]:
        size = len(data)
        if size > limits.input_bytes:
            raise _Failure(
                ErrorCode.INPUT_TOO_LARGE,
                f"the input is {size} bytes; the limit is {limits.input_bytes} bytes (input_bytes)",
            )
        if size > module.input_cap:
            raise _Failure(
                ErrorCode.INPUT_TOO_LARGE,
                f"the input is {size} bytes; evaluator {module.manifest.name} "
                f"accepts at most {module.input_cap} bytes",
            )
        memory_cap = limits.memory_bytes
        if self._pooling and memory_cap > self.config.pool_memory_bytes:
            memory_cap = self.config.pool_memory_bytes  # as _memory_cap, inline
        fresh = self._fresh
        fuel = limits.fuel or _UNMETERED_FUEL
        if fresh:
            instance = self._instantiate(module, memory_cap, fuel, self._ticks(limits.deadline_ms))
        else:
            try:
                instances = self._local.instances
            except AttributeError:
                instances = self._thread_instances()
            key = (pool_key, module.sha256)
            known = instances.get(key)
            if known is not None and known.module is module and known.memory_cap == memory_cap:
                instances.move_to_end(key)
                instance = known
            else:
                instance = self._reused_instance(
                    module, memory_cap, fuel, limits.deadline_ms, pool_key
                )
        context = instance.context
        if size:
            # in bounds: in_ptr + in_cap lies inside the memory (checked at instantiation),
            # memories never shrink, and size <= in_cap was checked above
            in_ptr = instance.in_ptr
            instance.view[in_ptr : in_ptr + size] = data
        context.set_fuel(fuel)
        # Computed once, right before the call (the ticker's lag is read here, not earlier).
        context.set_epoch_deadline(self._ticks(limits.deadline_ms))
        try:
            result = instance.eval.call1(size)
        except wasmtime.Trap as trap:
            used = fuel - context.fuel()
            self._discard(instance, pool_key)
            raise self._trap_failure(trap, instance, limits, used) from None
        except wasmtime.WasmtimeError as exc:
            self._discard(instance, pool_key)
            raise _Failure(
                ErrorCode.INTERNAL, f"wasmtime failed the call: {_first_line(exc)}"
            ) from None
        used = fuel - context.fuel()
        if instance.memory.size() != instance.view_size:
            instance.refresh_view()  # the guest grew its memory: the old view may be stale
        value: str | None = None
        if 0 <= result <= instance.out_cap and result <= limits.output_bytes:
            # The common case, inline: a value inside the output buffer, which lies inside the
            # memory (checked at instantiation). Anything else takes _read_output's checks.
            out_ptr = instance.out_ptr
            try:
                value = str(instance.view[out_ptr : out_ptr + result], "utf-8")
            except UnicodeDecodeError:
                value = None
        if value is None:
            try:
                value = self._read_output(instance, result, limits, used)
            except _Failure as failure:
                if failure.code is ErrorCode.GUEST_FAULT:
                    self._discard(instance, pool_key)
                elif not fresh:
                    self._clear_buffers(instance, size, result)
                raise
        if not fresh:
            self._clear_buffers(instance, size, result)
        return value, used

    def _read_output(self, instance: _Instance, result: int, limits: Limits, used: int) -> str:
        name = instance.module.manifest.name
        length = abs(result)
        if length > instance.out_cap:
            raise _Failure(
                ErrorCode.GUEST_FAULT,
                f"evaluator {name} returned {result}, but its output buffer holds "
                f"{instance.out_cap} bytes",
                used,
            )
        if length > limits.output_bytes:
            kind = "value" if result >= 0 else "error payload"
            raise _Failure(
                ErrorCode.OUTPUT_TOO_LARGE,
                f"evaluator {name} produced a {kind} of {length} bytes; the limit "
                f"is {limits.output_bytes} bytes (output_bytes)",
                used,
            )
        out_ptr = instance.out_ptr
        if out_ptr + length > instance.view_size:
            raise _Failure(
                ErrorCode.GUEST_FAULT, f"evaluator {name}'s output lies outside its memory", used
            )
        try:
            text = str(instance.view[out_ptr : out_ptr + length], "utf-8")
        except UnicodeDecodeError as exc:
            raise _Failure(
                ErrorCode.GUEST_FAULT,
                f"evaluator {name} returned bytes that are not UTF-8 "
                f"({exc.reason} at byte {exc.start})",
                used,
            ) from None
        if result >= 0:
            return text
        code_text, _, message = text.partition(":")
        code = _GUEST_CODES.get(code_text)
        if code is None:
            shown = code_text[:40]
            raise _Failure(
                ErrorCode.GUEST_FAULT,
                f"evaluator {name} returned an error with the unknown code "
                f"{shown!r}; guests may return only "
                f"{', '.join(sorted(_GUEST_CODES))}",
                used,
            )
        message = message[:_MAX_MESSAGE_CHARS] or f"{name}: {code.value}"
        raise _Failure(code, message, used)

    def _trap_failure(
        self, trap: wasmtime.Trap, instance: _Instance, limits: Limits, used: int
    ) -> _Failure:
        code = trap.trap_code
        if code is wasmtime.TrapCode.OUT_OF_FUEL:
            return _Failure(
                ErrorCode.FUEL_EXHAUSTED,
                f"the evaluation used all {limits.fuel} units of fuel (fuel limit)",
                used,
            )
        if code is wasmtime.TrapCode.INTERRUPT:
            return _Failure(
                ErrorCode.DEADLINE_EXCEEDED,
                f"the evaluation ran past its deadline of {limits.deadline_ms} ms",
                used,
            )
        if code is wasmtime.TrapCode.STACK_OVERFLOW:
            return _Failure(
                ErrorCode.STACK_OVERFLOW,
                "the evaluation exhausted the wasm stack "
                f"({self.config.max_wasm_stack_bytes} bytes): recursion too deep",
                used,
            )
        if instance.grow_was_refused():
            return _Failure(
                ErrorCode.MEMORY_LIMIT,
                f"the evaluator needed more than the memory limit of "
                f"{instance.memory_cap} bytes (memory_bytes) and stopped "
                f"({_trap_name(trap)})",
                used,
            )
        return _Failure(
            ErrorCode.GUEST_FAULT,
            f"evaluator {instance.module.manifest.name} trapped: {_trap_name(trap)}",
            used,
        )

    # -- instances -------------------------------------------------------------------------

    def memory_cap(self, limits: Limits) -> int:
        """The memory cap a module runs under with ``limits`` (the pool slot bounds it)."""
        return self._memory_cap(limits)

    def _memory_cap(self, limits: Limits) -> int:
        if self._pooling:
            return min(limits.memory_bytes, self.config.pool_memory_bytes)
        return limits.memory_bytes

    def _ticks(self, deadline_ms: int) -> int:
        """Epoch ticks from now until ``deadline_ms`` of wall-clock time has passed.

        The ticker may lag (a starved thread catches up in a burst); the deadline is set past
        the lag, so a burst never cuts a call short: it ends no earlier than ``deadline_ms``.
        """
        ticks = self._deadline_ticks.get(deadline_ms)
        if ticks is None:
            ticks = max(1, math.ceil(deadline_ms / self._tick_ms))
            self._deadline_ticks[deadline_ms] = ticks
        return ticks + (self._ticker.lag_ticks() if self._ticker is not None else 0)

    def _thread_instances(self) -> OrderedDict[tuple[str, str], _Instance]:
        instances: OrderedDict[tuple[str, str], _Instance] | None = getattr(
            self._local, "instances", None
        )
        if instances is None:
            instances = OrderedDict()
            self._local.instances = instances
        return instances

    def _reused_instance(
        self, module: LoadedModule, memory_cap: int, fuel: int, deadline_ms: int, pool_key: str
    ) -> _Instance:
        instances = self._thread_instances()
        key = (pool_key, module.sha256)
        instance = instances.get(key)
        if instance is not None and instance.module is module:
            if instance.memory_cap != memory_cap:
                if instance.memory.size() > memory_cap:
                    del instances[key]
                    return self._reused_instance(module, memory_cap, fuel, deadline_ms, pool_key)
                instance.store.set_limits(memory_size=memory_cap)
                instance.memory_cap = memory_cap
            instances.move_to_end(key)
            return instance
        instance = self._instantiate(module, memory_cap, fuel, self._ticks(deadline_ms))
        instances[key] = instance
        while len(instances) > self.config.instances_per_thread:
            instances.popitem(last=False)
        return instance

    def _discard(self, instance: _Instance, pool_key: str) -> None:
        instances = self._thread_instances()
        key = (pool_key, instance.module.sha256)
        if instances.get(key) is instance:
            del instances[key]

    def _clear_buffers(self, instance: _Instance, input_size: int, result: int) -> None:
        """Zeroes what crossed the boundary: the input written and the output returned.

        Bytes the guest wrote elsewhere (its heap, or output-buffer scratch past the returned
        length) are guest state, like any other, and persist in reuse mode; ``fresh`` mode is
        the setting for requests that must not share any state.
        """
        view = instance.view
        zeros = _zeros
        if input_size:
            in_ptr = instance.in_ptr
            view[in_ptr : in_ptr + input_size] = (
                zeros[:input_size] if input_size <= len(zeros) else _zero_source(input_size)
            )
        output_size = min(abs(result), instance.out_cap)
        if output_size:
            out_ptr = instance.out_ptr
            view[out_ptr : out_ptr + output_size] = (
                zeros[:output_size] if output_size <= len(zeros) else _zero_source(output_size)
            )

    def _instantiate(
        self,
        module: LoadedModule,
        memory_cap: int,
        fuel: int,
        ticks: int,
        *,
        trial: bool = False,
    ) -> _Instance:
        """A new store and instance of ``module``; raises _Failure (never EvaldError)."""
        if module._minimum_memory_bytes > memory_cap:
            raise _Failure(
                ErrorCode.MEMORY_LIMIT,
                f"evaluator {module.manifest.name} needs "
                f"{module._minimum_memory_bytes} bytes of memory at start; the "
                f"memory limit is {memory_cap} bytes (memory_bytes)",
            )
        store = wasmtime.Store(self._engine)
        store.set_limits(
            memory_size=memory_cap, table_elements=MAX_TABLE_ELEMENTS, tables=MAX_TABLES
        )
        instance = _Instance(module, store, memory_cap)
        context = instance.context
        context.set_fuel(fuel)
        context.set_epoch_deadline(ticks)
        try:
            wasm_instance = fast.instantiate(store, module._module)
        except wasmtime.Trap as trap:
            raise self._instantiation_trap(trap, store, module, memory_cap, fuel) from None
        except wasmtime.WasmtimeError as exc:
            raise _Failure(
                ErrorCode.INTERNAL,
                f"cannot instantiate evaluator {module.manifest.name}: {_first_line(exc)}",
            ) from None

        def func(name: str, params: int) -> fast.RawFunc:
            item = fast.export(store, wasm_instance, name)
            if not isinstance(item, wasmtime.Func):
                raise _Failure(ErrorCode.INTERNAL, f"export {name} vanished")
            return fast.RawFunc.bind(
                store, item, params=params, results=1, name=name, type_checked=True
            )

        memory = fast.export(store, wasm_instance, "memory")
        if not isinstance(memory, wasmtime.Memory):
            raise _Failure(ErrorCode.INTERNAL, "export memory vanished")
        instance.memory = fast.RawMemory(store, memory)
        instance.eval = func(module._eval_export, 1)
        if module._flag_export is not None:
            flag = fast.export(store, wasm_instance, module._flag_export)
            instance.flag = flag if isinstance(flag, wasmtime.Global) else None
        if trial:
            # The buffer functions run once per module, here: a guest without imports is
            # deterministic, so every later instance has the same buffers (their bounds are
            # still checked per instance below).
            try:
                version = func(VERSION_EXPORT, 0).call0()
                if version != ABI_VERSION:
                    raise _Failure(
                        ErrorCode.INVALID_MODULE,
                        f"{VERSION_EXPORT}() returned {version}; this daemon speaks "
                        f"ABI {ABI_VERSION}",
                    )
                in_ptr, in_cap, out_ptr, out_cap = (
                    func(name, 0).call0() & 0xFFFFFFFF for name in BUFFER_EXPORTS
                )
            except wasmtime.Trap as trap:
                raise _Failure(
                    ErrorCode.GUEST_FAULT,
                    f"a buffer function of evaluator {module.manifest.name} trapped: "
                    f"{_trap_name(trap)}",
                ) from None
        else:
            in_ptr, out_ptr = module._input_ptr, module._output_ptr
            in_cap, out_cap = module.input_cap, module.output_cap
        instance.refresh_view()
        memory_size = instance.view_size
        for label, ptr, cap in (("input", in_ptr, in_cap), ("output", out_ptr, out_cap)):
            if cap < 1 or ptr + cap > memory_size:
                raise _Failure(
                    ErrorCode.GUEST_FAULT,
                    f"evaluator {module.manifest.name}'s {label} buffer "
                    f"[{ptr}, {ptr + cap}) must hold at least one byte and lie "
                    f"inside its memory of {memory_size} bytes",
                )
        instance.in_ptr, instance.in_cap, instance.out_ptr, instance.out_cap = (
            in_ptr,
            in_cap,
            out_ptr,
            out_cap,
        )
        return instance

    def _instantiation_trap(
        self,
        trap: wasmtime.Trap,
        store: wasmtime.Store,
        module: LoadedModule,
        memory_cap: int,
        fuel: int,
    ) -> _Failure:
        name = module.manifest.name
        code = trap.trap_code
        if code is wasmtime.TrapCode.OUT_OF_FUEL:
            return _Failure(
                ErrorCode.FUEL_EXHAUSTED,
                f"the start function of evaluator {name} used all {fuel} units of "
                "fuel; an evaluator must not compute at instantiation",
                fuel,
            )
        if code is wasmtime.TrapCode.INTERRUPT:
            return _Failure(
                ErrorCode.DEADLINE_EXCEEDED,
                f"the start function of evaluator {name} ran past the deadline; "
                "an evaluator must not compute at instantiation",
            )
        if code is wasmtime.TrapCode.STACK_OVERFLOW:
            return _Failure(
                ErrorCode.STACK_OVERFLOW,
                f"the start function of evaluator {name} exhausted the wasm stack",
            )
        return _Failure(
            ErrorCode.GUEST_FAULT,
            f"the start function of evaluator {name} trapped: {_trap_name(trap)}",
        )
