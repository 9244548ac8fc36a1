"""Loading a module: validate, compile (or take it from the cache), trial-instantiate.

Everything that can refuse a module happens here, once, and ends in ``EvaldError``
(``INVALID_MODULE``) with a message that says what to fix; what passes is a
:class:`~evald.host._loaded_module.LoadedModule` that every call can instantiate cheaply.

1. **Validate** against ABI v1 (:func:`~evald.host._abi.inspect_module`): size, exports, no
   imports, the manifest, the declared memory against the cap it will run under.
2. **Compile**, after checking what each function would cost the compiler
   (:mod:`evald.host._compile_cost`) and rewriting the module so a refused ``memory.grow`` is
   recorded (:mod:`evald.host._instrument`) — or deserialize it from the disk cache
   (:mod:`evald.host._module_cache`). Compiled code is also kept in memory by hash, so loading
   the same bytes again (another tenant, another limit) compiles nothing. A module compiled
   elsewhere (:mod:`evald.host._compiler`, registration's worker process) is adopted instead.
3. **Trial-instantiate** under ``HostConfig.load_fuel`` and ``load_deadline_ms``: the start
   function must not compute, ``evald_abi_version`` must answer this daemon's version, and the
   four buffer functions run here, once, so later instances never call them. Before any of
   them runs, the trial instance's memory is read: its size and non-zero pages are what a new
   instance has, and what a reset puts back (``isolation = "fresh"``, resettable modules).

The compiled module is linked once (wasmtime's ``InstancePre``), so each instantiation skips
import resolution.
"""

from __future__ import annotations

import hashlib
import logging
import threading

import wasmtime

from evald.contract import (
    ABI_VERSION,
    BUFFER_EXPORTS,
    EVAL_EXPORT,
    VERSION_EXPORT,
    ErrorCode,
    EvaldError,
    Manifest,
)
from evald.host._abi import WASM_PAGE_BYTES, inspect_module
from evald.host._compile_cost import check_compile_cost
from evald.host._compiler import CompiledModule
from evald.host._deadline import EpochDeadlines
from evald.host._engine import engine_fingerprint
from evald.host._instance import bind_function, start_instance
from evald.host._instrument import FRESH_WRAPPER_EXPORT, GROW_FLAG_EXPORT, instrument_memory_grow
from evald.host._limits import HostConfig
from evald.host._loaded_module import LinkedModule, LoadedModule, TrialImage
from evald.host._memory_reset import pristine_pages as _pristine_pages
from evald.host._module_cache import ModuleCache
from evald.host._outcome import Failure, first_line, trap_name

__all__ = ["ModuleLoader"]

_log = logging.getLogger("evald.host")


class ModuleLoader:
    """Turns module bytes into :class:`LoadedModule` values for one engine; thread-safe."""

    def __init__(
        self, engine: wasmtime.Engine, config: HostConfig, deadlines: EpochDeadlines
    ) -> None:
        self._engine = engine
        self._config = config
        self._deadlines = deadlines
        self.cache = ModuleCache(
            config.cache_dir, engine, engine_fingerprint(config, pooling=config.pooling)
        )
        #: Compiled code by module hash: (code, grow observed, came from the disk cache).
        self._compiled: dict[str, tuple[wasmtime.Module, bool, bool]] = {}
        self._linker = wasmtime.Linker(engine)
        self._compile_lock = threading.Lock()

    def load(self, wasm: bytes, memory_cap: int) -> LoadedModule:
        """Validates, compiles and trial-instantiates ``wasm`` for a memory cap of
        ``memory_cap`` bytes (see the module docstring).

        Raises:
            EvaldError: ``INVALID_MODULE`` with an actionable message, for any problem.
        """
        manifest, info = inspect_module(
            wasm,
            max_module_bytes=self._config.module_bytes,
            max_memory_bytes=memory_cap,
            engine=self._engine,
        )
        sha256 = hashlib.sha256(wasm).hexdigest()
        eval_index = next(e.index for e in info.exports if e.name == EVAL_EXPORT)
        with self._compile_lock:
            known = self._compiled.get(sha256)
        if known is None:

            def compile_module() -> wasmtime.Module:
                check_compile_cost(wasm, info)
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
                        f"wasmtime cannot compile the module: {first_line(exc)}",
                    ) from exc

            compiled, from_cache = self.cache.load(sha256, compile_module)
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
            resettable=_resettable(compiled),
            minimum_memory_bytes=info.memories[0].minimum_pages * WASM_PAGE_BYTES,
            from_cache=from_cache,
            memory_cap=memory_cap,
        )

    def adopt(self, wasm: bytes, compiled: CompiledModule, memory_cap: int) -> LoadedModule:
        """A module validated and compiled elsewhere, trial-instantiated here.

        Nothing is looked up or kept by hash, so the cost does not depend on what was loaded
        before; :meth:`store_compiled` writes the disk cache once the module is accepted.

        Raises:
            EvaldError: ``INVALID_MODULE`` (the code does not load here, or the trial failed).
        """
        try:
            module = wasmtime.Module.deserialize(self._engine, compiled.code)
        except wasmtime.WasmtimeError as exc:
            raise EvaldError(
                ErrorCode.INVALID_MODULE, f"the compiled module does not load: {first_line(exc)}"
            ) from exc
        return self._trial_load(
            compiled.manifest,
            hashlib.sha256(wasm).hexdigest(),
            len(wasm),
            module,
            grow_observed=compiled.grow_observed,
            resettable=_resettable(module),
            minimum_memory_bytes=compiled.minimum_memory_bytes,
            from_cache=False,
            memory_cap=memory_cap,
        )

    def store_compiled(self, module: LoadedModule) -> None:
        """Writes ``module``'s compiled code to the disk cache."""
        self.cache.store(module.sha256, module.code)

    def forget(self, sha256: str) -> None:
        """Drops the compiled code kept in memory for ``sha256`` (the disk cache keeps it)."""
        with self._compile_lock:
            self._compiled.pop(sha256, None)

    def discard_code(self, sha256: str) -> None:
        """Drops the compiled code kept for ``sha256``, in memory and on disk."""
        self.forget(sha256)
        self.cache.remove(sha256)

    def _trial_load(
        self,
        manifest: Manifest,
        sha256: str,
        size_bytes: int,
        compiled: wasmtime.Module,
        *,
        grow_observed: bool,
        resettable: bool,
        minimum_memory_bytes: int,
        from_cache: bool,
        memory_cap: int,
    ) -> LoadedModule:
        try:
            pre = self._linker.instantiate_pre(compiled)
        except wasmtime.WasmtimeError as exc:
            raise EvaldError(
                ErrorCode.INVALID_MODULE, f"the module does not link: {first_line(exc)}"
            ) from exc
        linked = LinkedModule(
            manifest=manifest,
            sha256=sha256,
            size_bytes=size_bytes,
            code=compiled,
            pre=pre,
            grow_observed=grow_observed,
            resettable=resettable,
            minimum_memory_bytes=minimum_memory_bytes,
            from_cache=from_cache,
        )
        try:
            trial = self._trial(linked, memory_cap)
        except Failure as failure:
            raise EvaldError(
                ErrorCode.INVALID_MODULE, f"trial instantiation failed: {failure.message}"
            ) from None
        return LoadedModule(linked, trial)

    def _trial(self, module: LinkedModule, memory_cap: int) -> TrialImage:
        """Instantiates ``module`` under the load budget, checks its ABI version and returns
        what every later instance will have: a new instance's memory, read before any guest
        function runs, and its buffers (input pointer and capacity, output pointer and
        capacity), placed.

        The buffer functions run once per module, here: a guest without imports is
        deterministic, so every later instance has the same buffers.

        Raises:
            Failure: for anything the trial refuses.
        """
        instance, wasm_instance = start_instance(
            self._engine,
            module,
            memory_cap,
            self._config.load_fuel,
            self._deadlines.ticks(self._config.load_deadline_ms),
        )
        # what a new instance's memory holds, read before any guest function runs
        pristine_bytes = instance.memory.size()
        pristine_pages = _pristine_pages(instance.memory) if module.resettable else ()
        store = instance.store
        try:
            version = bind_function(store, wasm_instance, VERSION_EXPORT, 0).call0()
            if version != ABI_VERSION:
                raise Failure(
                    ErrorCode.INVALID_MODULE,
                    f"{VERSION_EXPORT}() returned {version}; this daemon speaks ABI {ABI_VERSION}",
                )
            in_ptr, in_cap, out_ptr, out_cap = (
                bind_function(store, wasm_instance, name, 0).call0() & 0xFFFFFFFF
                for name in BUFFER_EXPORTS
            )
        except wasmtime.Trap as trap:
            raise Failure(
                ErrorCode.GUEST_FAULT,
                f"a buffer function of evaluator {module.manifest.name} trapped: {trap_name(trap)}",
            ) from None
        instance.place_buffers(in_ptr, in_cap, out_ptr, out_cap)
        return TrialImage(in_ptr, in_cap, out_ptr, out_cap, pristine_bytes, pristine_pages)


def _resettable(compiled: wasmtime.Module) -> bool:
    """Whether the rewrite gave ``compiled`` the fresh wrapper (:mod:`evald.host._instrument`)."""
    return any(export.name == FRESH_WRAPPER_EXPORT for export in compiled.exports)
