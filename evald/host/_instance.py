"""One live instance of a loaded module: its store, its raw call bindings and its buffers.

An instance is made in two steps so loading and calling share one way of making it:
:func:`start_instance` creates the store under its caps and runs the module's instantiation
(start function included) under a fuel and deadline budget; :meth:`Instance.place_buffers`
then checks that the guest's input and output buffers lie inside its memory. Loading asks the
guest where its buffers are, once (:mod:`evald.host._module_loader`); every later instance
takes them from the :class:`~evald.host._loaded_module.LoadedModule` (:func:`instantiate`).

Per store, at most :data:`MAX_TABLES` tables of :data:`MAX_TABLE_ELEMENTS` elements. Tables
live outside linear memory, so the memory cap does not bound them, and one ``table.fill`` or
``table.grow`` is a single instruction that neither fuel nor the epoch interrupts: without this
cap a guest could commit gigabytes and run for seconds past its deadline in one call.

The call path copies through a byte view of the guest memory (no foreign call per copy); the
view is taken again only when the memory size changed (:meth:`Instance.refresh_view`).

A *fresh* instance (``isolation = "fresh"``, a resettable module: :mod:`evald.host._instrument`)
is called through the fresh wrapper, which puts the globals back before the guest runs, and
carries a :class:`~evald.host._memory_reset.MemoryReset` that puts its memory back after each
call (:meth:`Instance.reset`): the next call starts from a new instance's state.
"""

from __future__ import annotations

import logging
from typing import Final

import wasmtime

from evald.contract import ErrorCode
from evald.host import _fastcall as fast
from evald.host._loaded_module import LinkedModule, LoadedModule
from evald.host._memory_reset import MemoryReset, memory_reset_unavailable
from evald.host._outcome import Failure, first_line, start_trap_failure

__all__ = [
    "MAX_TABLES",
    "MAX_TABLE_ELEMENTS",
    "Instance",
    "PoolExhausted",
    "bind_function",
    "instantiate",
    "start_instance",
]

_log = logging.getLogger("evald.host")

#: Table caps per store (see the module docstring); an evaluator needs one small function table.
MAX_TABLES: Final = 4
MAX_TABLE_ELEMENTS: Final = 65_536
#: Zeroes copied over the buffers after a reused call; grown (replaced) when a call needs more.
_zeros = memoryview(bytes(4096))


def _zero_source(length: int) -> memoryview:
    """``length`` zero bytes to copy from (a view: no allocation per call)."""
    global _zeros
    zeros = _zeros
    if len(zeros) < length:
        zeros = _zeros = memoryview(bytes(max(length, 2 * len(zeros))))
    return zeros[:length]


class Instance:
    """One live instance with its raw call bindings; used by one thread only.

    The call path reads and writes these slots directly (a reused call makes no other Python
    call on this object than :meth:`clear_buffers`).
    """

    __slots__ = (
        "context",
        "eval",
        "flag",
        "held_bytes",
        "in_cap",
        "in_ptr",
        "memory",
        "memory_cap",
        "module",
        "out_cap",
        "out_ptr",
        "resetter",
        "store",
        "view",
        "view_size",
    )

    def __init__(self, module: LinkedModule, store: wasmtime.Store, memory_cap: int) -> None:
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
        #: The memory the instance pool charged for it (its size when last counted).
        self.held_bytes = 0
        #: Puts the memory back after a call (fresh instances of resettable modules only).
        self.resetter: MemoryReset | None = None

    def refresh_view(self) -> None:
        """Takes a new view of the memory (after instantiation, or a call that grew it)."""
        self.view = self.memory.view()
        self.view_size = len(self.view)

    def grow_was_refused(self) -> bool:
        """Whether a ``memory.grow`` was refused in this instance (rewritten modules only)."""
        if self.flag is None:
            return False
        try:
            return bool(self.flag.value(self.store))
        except wasmtime.WasmtimeError:
            return False

    def place_buffers(self, in_ptr: int, in_cap: int, out_ptr: int, out_cap: int) -> None:
        """Records the guest's buffers once they are known to lie inside its memory.

        Checked for every instance, not only at the trial: the call path then copies into and
        out of them through the memory view without a bounds check of its own.

        Raises:
            Failure: ``GUEST_FAULT`` for an empty buffer or one outside the memory.
        """
        self.refresh_view()
        memory_size = self.view_size
        for label, ptr, cap in (("input", in_ptr, in_cap), ("output", out_ptr, out_cap)):
            if cap < 1 or ptr + cap > memory_size:
                raise Failure(
                    ErrorCode.GUEST_FAULT,
                    f"evaluator {self.module.manifest.name}'s {label} buffer "
                    f"[{ptr}, {ptr + cap}) must hold at least one byte and lie "
                    f"inside its memory of {memory_size} bytes",
                )
        self.in_ptr, self.in_cap, self.out_ptr, self.out_cap = in_ptr, in_cap, out_ptr, out_cap

    def clear_buffers(self, input_size: int, result: int) -> None:
        """Zeroes what crossed the boundary: the input written and the output returned.

        Bytes the guest wrote elsewhere (its heap, or output-buffer scratch past the returned
        length) are guest state, like any other, and persist in reuse mode; ``fresh`` mode is
        the setting for requests that must not share any state.
        """
        view = self.view
        zeros = _zeros
        if input_size:
            in_ptr = self.in_ptr
            view[in_ptr : in_ptr + input_size] = (
                zeros[:input_size] if input_size <= len(zeros) else _zero_source(input_size)
            )
        output_size = min(abs(result), self.out_cap)
        if output_size:
            out_ptr = self.out_ptr
            view[out_ptr : out_ptr + output_size] = (
                zeros[:output_size] if output_size <= len(zeros) else _zero_source(output_size)
            )

    def reset(self) -> bool:
        """Puts a fresh instance back to a new instance's state after a call: its memory by
        :class:`~evald.host._memory_reset.MemoryReset`, over the whole memory when the call grew
        it (its globals, the guest's memory size among them, are put back by the fresh wrapper
        when the next call enters). Returns False when it cannot be (not a fresh instance, its
        memory moved, or the scan failed): the caller must then drop it."""
        resetter = self.resetter
        if resetter is None:
            return False
        if self.view_size != resetter.size and not resetter.follow(self.memory):
            return False
        try:
            resetter.reset()
        except OSError:
            _log.exception("cannot reset an instance of %s; dropping it", self.module)
            return False
        return True


def bind_function(
    store: wasmtime.Store, wasm_instance: wasmtime.Instance, name: str, params: int
) -> fast.RawFunc:
    """The raw binding of export ``name`` (``params`` i32 in, one i32 out; checked by ABI
    validation, so a missing one is the host's error)."""
    item = fast.export(store, wasm_instance, name)
    if not isinstance(item, wasmtime.Func):
        raise Failure(ErrorCode.INTERNAL, f"export {name} vanished")
    return fast.RawFunc.bind(store, item, params=params, results=1, name=name, type_checked=True)


def start_instance(
    engine: wasmtime.Engine,
    module: LinkedModule,
    memory_cap: int,
    fuel: int,
    ticks: int,
    *,
    fresh: bool = False,
) -> tuple[Instance, wasmtime.Instance]:
    """A new store and instance of ``module``, its buffers not yet placed; with ``fresh`` (and
    a resettable module) bound to the fresh wrapper.

    Returns:
        The instance (memory, ``evald_eval`` and the grow flag bound) and the wasmtime
        instance, to bind further exports from.

    Raises:
        Failure: never ``EvaldError``; a trap in the start function is mapped by
            :func:`~evald.host._outcome.start_trap_failure`.
    """
    if module.minimum_memory_bytes > memory_cap:
        raise Failure(
            ErrorCode.MEMORY_LIMIT,
            f"evaluator {module.manifest.name} needs "
            f"{module.minimum_memory_bytes} bytes of memory at start; the "
            f"memory limit is {memory_cap} bytes (memory_bytes)",
        )
    store = wasmtime.Store(engine)
    store.set_limits(memory_size=memory_cap, table_elements=MAX_TABLE_ELEMENTS, tables=MAX_TABLES)
    instance = Instance(module, store, memory_cap)
    context = instance.context
    context.set_fuel(fuel)
    context.set_epoch_deadline(ticks)
    try:
        wasm_instance = fast.instantiate(store, module.pre)
    except wasmtime.Trap as trap:
        raise start_trap_failure(trap, evaluator=module.manifest.name, fuel=fuel) from None
    except wasmtime.WasmtimeError as exc:
        message = first_line(exc)
        if "concurrent" in message and "limit" in message:
            raise PoolExhausted(
                ErrorCode.UNAVAILABLE,
                f"no instance slot is free for evaluator {module.manifest.name}: every slot of "
                f"the pooling allocator is in use (host pool_instances; {message})",
            ) from None
        raise Failure(
            ErrorCode.INTERNAL,
            f"cannot instantiate evaluator {module.manifest.name}: {message}",
        ) from None
    memory = fast.export(store, wasm_instance, "memory")
    if not isinstance(memory, wasmtime.Memory):
        raise Failure(ErrorCode.INTERNAL, "export memory vanished")
    instance.memory = fast.RawMemory(store, memory)
    export = module.fresh_export if fresh and module.fresh_export else module.eval_export
    instance.eval = bind_function(store, wasm_instance, export, 1)
    flag_export = module.flag_export
    if flag_export is not None:
        flag = fast.export(store, wasm_instance, flag_export)
        instance.flag = flag if isinstance(flag, wasmtime.Global) else None
    return instance, wasm_instance


def instantiate(
    engine: wasmtime.Engine,
    module: LoadedModule,
    memory_cap: int,
    fuel: int,
    ticks: int,
    *,
    fresh: bool = False,
) -> Instance:
    """A ready instance of a loaded module, its buffers where the trial found them.

    A guest without imports is deterministic, so every instance has the buffers the trial saw;
    their bounds are still checked per instance (:meth:`Instance.place_buffers`). With
    ``fresh``, an instance of a resettable module gets its reset (:meth:`Instance.reset`)
    where the kernel allows it (:func:`~evald.host._memory_reset.memory_reset_unavailable`).

    Raises:
        Failure: as :func:`start_instance` and :meth:`Instance.place_buffers`.
    """
    instance, _ = start_instance(engine, module, memory_cap, fuel, ticks, fresh=fresh)
    trial = module.trial
    instance.place_buffers(trial.input_ptr, trial.input_cap, trial.output_ptr, trial.output_cap)
    if fresh and module.resettable and not memory_reset_unavailable():
        if instance.view_size == trial.pristine_bytes:
            instance.resetter = MemoryReset(instance.memory, trial.pristine_pages)
    return instance


class PoolExhausted(Failure):
    """Instantiation found no free slot in the pooling allocator (``HostConfig.pool_instances``):
    kept instances can be dropped to make room."""
