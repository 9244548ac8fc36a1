"""The raw ctypes call path into wasmtime: about 1 µs per call instead of about 100 µs.

``wasmtime.Func.__call__`` queries the function type and converts every value on every call.
For a function whose parameters and results are all ``i32`` none of that is needed: the C API's
``wasmtime_func_call_unchecked`` takes a flat array of raw values that holds the arguments on
entry and the results on return. This module binds that function through a private ``CDLL``
handle on wasmtime's own shared library and calls it with pre-built ctypes arguments, so a call
is one foreign call with no conversions.

Contract (the C function is *unchecked*: a violation is memory corruption, not an exception):

* Bind once per (store, func) with :meth:`RawFunc.bind`; it checks at bind time that the
  function belongs to ``store`` and that its parameters and results are exactly the declared
  number of ``i32`` values. A bound function is called only with that store alive (it keeps a
  reference) and only from one thread at a time (it owns its argument array and trap slot;
  wasmtime stores are single-threaded anyway).
* Arguments are Python ints in the ``i32`` range (wrapped to 32 bits, as wasm does);
  the result is a signed 32-bit int.
* A trap raises ``wasmtime.Trap`` (read ``trap_code``); any other failure raises
  ``wasmtime.WasmtimeError``. ``Trap`` is not a ``WasmtimeError``: callers catch both.

The guest call releases the GIL (a ``CDLL`` function), so the epoch ticker thread keeps running
while a guest executes and two stores run on two cores. The short helpers (fuel, epoch deadline,
memory base and size, memmove/memset) never run guest code, so they go through ``PyDLL``
handles that keep the GIL: no release/re-acquire round trip for a call of a few nanoseconds.

:class:`~evald.host._memory_reset.MemoryReset` puts a linear memory back to its initial
contents (``isolation = "fresh"`` with a kept instance): its own module, its own contract.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from typing import Any, Final, cast

import wasmtime
from wasmtime import _ffi as ffi

__all__ = [
    "RawFunc",
    "RawMemory",
    "RawStore",
    "context_address",
    "export",
    "instantiate",
    "store_id",
]

_VP = ctypes.c_void_p
_GIL_RELEASED: Final = ctypes.CDLL(str(ffi.filename))
_GIL_HELD: Final = ctypes.PyDLL(str(ffi.filename))

# argtypes stay unset: every argument is passed as a pre-built ctypes object.
_call_unchecked = _GIL_RELEASED.wasmtime_func_call_unchecked
_call_unchecked.restype = _VP

# No argtypes either: RawStore passes pre-built ctypes arguments (a c_uint64 whose value it
# sets), which spares the conversion of each argument (about 70 ns a call).
_set_fuel = _GIL_HELD.wasmtime_context_set_fuel
_set_fuel.restype = _VP

_get_fuel = _GIL_HELD.wasmtime_context_get_fuel
_get_fuel.restype = _VP

_set_epoch_deadline = _GIL_HELD.wasmtime_context_set_epoch_deadline
_set_epoch_deadline.restype = None

_memory_data = _GIL_HELD.wasmtime_memory_data
_memory_data.argtypes = [_VP, _VP]
_memory_data.restype = _VP

_memory_data_size = _GIL_HELD.wasmtime_memory_data_size
_memory_data_size.argtypes = [_VP, _VP]
_memory_data_size.restype = ctypes.c_size_t

_export_get = _GIL_HELD.wasmtime_instance_export_get
_export_get.argtypes = [_VP, _VP, ctypes.c_char_p, ctypes.c_size_t, _VP]
_export_get.restype = ctypes.c_bool


_CopyFunction = Callable[[int, bytes, int], object]
_FillFunction = Callable[[int, int, int], object]


def _libc_function(name: str, argtypes: list[type[ctypes._SimpleCData[Any]]]) -> Any:
    """libc's ``name`` through a GIL-keeping handle, or None where it cannot be found."""
    try:
        function = getattr(ctypes.PyDLL(None), name)
    except (AttributeError, OSError):
        return None
    function.argtypes = argtypes
    function.restype = _VP
    return function


_memmove: _CopyFunction = (
    _libc_function("memmove", [_VP, ctypes.c_char_p, ctypes.c_size_t]) or ctypes.memmove
)
_memset: _FillFunction = _libc_function("memset", [_VP, ctypes.c_int, ctypes.c_size_t]) or (
    ctypes.memset
)

_EXTERN_FUNC = ffi.WASMTIME_EXTERN_FUNC.value
_EXTERN_GLOBAL = ffi.WASMTIME_EXTERN_GLOBAL.value
_EXTERN_MEMORY = ffi.WASMTIME_EXTERN_MEMORY.value

_I32 = wasmtime.ValType.i32()
_STORE_IDS: weakref.WeakKeyDictionary[wasmtime.Store, int] = weakref.WeakKeyDictionary()


def store_id(store: wasmtime.Store) -> int:
    """wasmtime's internal id of ``store``: every object of the store carries it.

    wasmtime aborts the process (a Rust panic across the C boundary) when an object is used
    with another store, so bindings compare ids before any call. The C API has no getter, so
    the id is read from a throwaway global created in the store once (cached per store).
    """
    known = _STORE_IDS.get(store)
    if known is None:
        probe = wasmtime.Global(store, wasmtime.GlobalType(_I32, False), wasmtime.Val.i32(0))
        known = int(probe._global.store_id)
        _STORE_IDS[store] = known
    return known


def context_address(store: wasmtime.Store) -> int:
    """The address of ``store``'s ``wasmtime_context_t``; valid while ``store`` lives."""
    address = ctypes.cast(store._context(), _VP).value
    if not address:
        raise ValueError("the store is closed")
    return address


def instantiate(store: wasmtime.Store, pre: wasmtime.InstancePre) -> wasmtime.Instance:
    """An instance of the pre-linked module ``pre`` in ``store``, which also tells the store's
    id for free.

    The new instance carries the id of the store it was made in, which spares
    :func:`store_id` its probe (a throwaway global, about as costly as the instance itself).

    Raises:
        wasmtime.Trap: the start function trapped.
        wasmtime.WasmtimeError: instantiation failed (limits, a full instance pool, another
            engine).
    """
    instance = pre.instantiate(store)
    _STORE_IDS.setdefault(store, int(instance._instance.store_id))
    return instance


def export(
    store: wasmtime.Store, instance: wasmtime.Instance, name: str
) -> wasmtime.Func | wasmtime.Memory | wasmtime.Global | None:
    """One export of ``instance`` by name, or None (also for tables and tags).

    ``Instance.exports(store)`` wraps every export of the instance (about 100 µs); this looks up
    one name with one foreign call.
    """
    if instance._instance.store_id != store_id(store):
        raise wasmtime.WasmtimeError("the instance belongs to another store")
    item = ffi.wasmtime_extern_t()
    encoded = name.encode("utf-8")
    if not _export_get(
        context_address(store),
        ctypes.addressof(instance._instance),
        encoded,
        len(encoded),
        ctypes.addressof(item),
    ):
        return None
    kind = cast(int, item.kind)  # a ctypes field reads as int at run time
    if kind == _EXTERN_FUNC:
        return wasmtime.Func._from_raw(item.of.func)
    if kind == _EXTERN_MEMORY:
        return wasmtime.Memory._from_raw(item.of.memory)
    if kind == _EXTERN_GLOBAL:
        return wasmtime.Global._from_raw(item.of.global_)
    return None


def _raise_error(error_address: int) -> None:
    error = ctypes.cast(_VP(error_address), ctypes.POINTER(ffi.wasmtime_error_t))
    raise wasmtime.WasmtimeError._from_ptr(error)


class RawStore:
    """Fuel and epoch deadline of one store, through pre-built arguments; one thread."""

    __slots__ = ("_context", "_fuel", "_fuel_address", "_store", "_u64", "address")

    def __init__(self, store: wasmtime.Store) -> None:
        self._store = store
        self.address = context_address(store)
        self._context = _VP(self.address)
        self._fuel = ctypes.c_uint64()
        self._fuel_address = _VP(ctypes.addressof(self._fuel))
        self._u64 = ctypes.c_uint64()  # the argument of set_fuel / set_epoch_deadline

    def set_fuel(self, fuel: int) -> None:
        """Sets the fuel left in the store (the engine must consume fuel)."""
        argument = self._u64
        argument.value = fuel
        error = _set_fuel(self._context, argument)
        if error:
            _raise_error(error)

    def fuel(self) -> int:
        """The fuel left in the store; reading it after a trap is allowed."""
        error = _get_fuel(self._context, self._fuel_address)
        if error:
            _raise_error(error)
        return self._fuel.value

    def set_epoch_deadline(self, ticks_after_current: int) -> None:
        """Traps the store's wasm code once the engine epoch reaches current + ticks."""
        argument = self._u64
        argument.value = ticks_after_current
        _set_epoch_deadline(self._context, argument)


class RawFunc:
    """One exported function bound to one store for raw calls; see the module contract."""

    __slots__ = (
        "_args",
        "_args_ref",
        "_context",
        "_first",
        "_func",
        "_func_ref",
        "_nargs",
        "_store",
        "_trap",
        "_trap_ref",
        "_width",
        "name",
    )

    _args: ctypes.Array[ffi.wasmtime_val_raw_t]
    _func: ffi.wasmtime_func_t
    _trap: ctypes.c_void_p

    def __init__(
        self, store: wasmtime.Store, func: wasmtime.Func, params: int, results: int, name: str
    ) -> None:
        """Private: use :meth:`bind`, which checks the contract first."""
        self.name = name or "function"
        self._store = store
        self._context = _VP(context_address(store))
        self._func = ffi.wasmtime_func_t.from_buffer_copy(func._func)  # at a stable address
        self._func_ref = ctypes.byref(self._func)
        self._nargs = params
        self._width = ctypes.c_size_t(max(params, results, 1))
        self._args = (ffi.wasmtime_val_raw_t * self._width.value)()
        self._args_ref = ctypes.byref(self._args)
        self._first = ctypes.c_int32.from_buffer(self._args)  # i32 view of the first raw value
        self._trap = _VP()
        self._trap_ref = ctypes.byref(self._trap)

    @classmethod
    def bind(
        cls,
        store: wasmtime.Store,
        func: wasmtime.Func,
        *,
        params: int,
        results: int,
        name: str = "",
        type_checked: bool = False,
    ) -> RawFunc:
        """Binds ``func`` (an export of an instance in ``store``) for raw calls.

        Parameters:
            store: the store that owns ``func``; kept alive by the binding.
            func: the exported function.
            params, results: the exact number of ``i32`` parameters and results expected.
            name: used in error messages only.
            type_checked: the caller has already checked this export's type on the module
                (:func:`evald.host._abi.validate_module` does); skips the type query (about 20 µs).
                The store check is never skipped.

        Raises:
            TypeError: not a function, or its type is not ``params`` x i32 -> ``results`` x i32.
            wasmtime.WasmtimeError: ``func`` does not belong to ``store``.
        """
        label = name or "function"
        if not isinstance(func, wasmtime.Func):
            raise TypeError(f"{label} is not a function")
        if func._func.store_id != store_id(store):
            raise wasmtime.WasmtimeError(f"{label} belongs to another store")
        if not type_checked:
            ty = func.type(store)
            got_params, got_results = list(ty.params), list(ty.results)
            if got_params != [_I32] * params or got_results != [_I32] * results:
                raise TypeError(
                    f"{label} has type ({', '.join(map(str, got_params))}) -> "
                    f"({', '.join(map(str, got_results))}); expected "
                    f"({', '.join(['i32'] * params)}) -> ({', '.join(['i32'] * results)})"
                )
        return cls(store, func, params, results, name)

    def __call__(self, *args: int) -> int:
        """Calls the function; returns its first result (0 when it has none).

        Raises:
            wasmtime.Trap: the guest trapped.
            wasmtime.WasmtimeError: the call failed for another reason.
        """
        if len(args) != self._nargs:
            raise TypeError(f"{self.name} takes {self._nargs} arguments, got {len(args)}")
        raw = self._args
        for index, value in enumerate(args):
            raw[index].i32 = value
        return self._invoke()

    def call0(self) -> int:
        """``self()`` for a function without parameters, without the argument loop."""
        if self._nargs:
            raise TypeError(f"{self.name} takes {self._nargs} arguments")
        return self._invoke()

    def call1(self, arg: int) -> int:
        """``self(arg)`` for a function with one parameter, without the argument loop."""
        if self._nargs != 1:
            raise TypeError(f"{self.name} takes {self._nargs} arguments")
        self._first.value = arg
        # _invoke, inline (the evaluation path calls this once per evaluation)
        error = _call_unchecked(
            self._context, self._func_ref, self._args_ref, self._width, self._trap_ref
        )
        if error:
            _raise_error(error)
        trap = self._trap.value
        if trap:
            self._trap.value = None
            raise wasmtime.Trap._from_ptr(ctypes.cast(_VP(trap), ctypes.POINTER(ffi.wasm_trap_t)))
        return self._first.value

    def _invoke(self) -> int:
        error = _call_unchecked(
            self._context, self._func_ref, self._args_ref, self._width, self._trap_ref
        )
        if error:
            _raise_error(error)
        trap = self._trap.value
        if trap:
            self._trap.value = None
            raise wasmtime.Trap._from_ptr(ctypes.cast(_VP(trap), ctypes.POINTER(ffi.wasm_trap_t)))
        return self._first.value


class RawMemory:
    """A linear memory of one store, read and written through its base address.

    Base and size are looked up on every access (``memory.grow`` may move the memory) and every
    range is checked against the current size. Same single-store, single-thread contract as
    :class:`RawFunc`.
    """

    __slots__ = ("_context", "_memory", "_memory_ref", "_store")

    def __init__(self, store: wasmtime.Store, memory: wasmtime.Memory) -> None:
        if not isinstance(memory, wasmtime.Memory):
            raise TypeError("not a memory")
        if memory._memory._anon_1.store_id != store_id(store):
            raise wasmtime.WasmtimeError("the memory belongs to another store")
        self._store = store
        self._context = _VP(context_address(store))
        self._memory = ffi.wasmtime_memory_t.from_buffer_copy(memory._memory)
        self._memory_ref = _VP(ctypes.addressof(self._memory))

    def size(self) -> int:
        """The memory's current size in bytes."""
        size: int = _memory_data_size(self._context, self._memory_ref)
        return size

    def base(self) -> int:
        """The memory's base address now (it may move when the memory grows)."""
        base: int = _memory_data(self._context, self._memory_ref) or 0
        return base

    def _base(self, ranges: tuple[tuple[int, int], ...]) -> int:
        size: int = _memory_data_size(self._context, self._memory_ref)
        for offset, length in ranges:
            if offset < 0 or length < 0 or offset + length > size:
                raise IndexError(
                    f"[{offset}, {offset + length}) is outside linear memory of {size} bytes"
                )
        base: int = _memory_data(self._context, self._memory_ref)
        return base

    def view(self) -> memoryview:
        """A writable byte view of the whole memory as it is now, for copies without a foreign
        call. It is valid only until the memory grows (a guest call may grow it, and a grown
        memory may move) and while the store lives: re-check :meth:`size` after every guest
        call and take a new view when it changed. Slicing a view never checks against the
        guest's buffers: callers check their ranges first."""
        size: int = _memory_data_size(self._context, self._memory_ref)
        if not size:
            return memoryview(bytearray())
        base: int = _memory_data(self._context, self._memory_ref)
        return memoryview((ctypes.c_ubyte * size).from_address(base)).cast("B")

    def write(self, offset: int, data: bytes) -> None:
        """Copies ``data`` to ``offset`` (one memmove)."""
        length = len(data)
        base = self._base(((offset, length),))
        if length:
            _memmove(base + offset, data, length)

    def read(self, offset: int, length: int) -> bytes:
        """Copies ``length`` bytes from ``offset``."""
        base = self._base(((offset, length),))
        return ctypes.string_at(base + offset, length) if length else b""

    def fill(self, offset: int, length: int, byte: int = 0) -> None:
        """Sets ``length`` bytes at ``offset`` to ``byte`` (one memset)."""
        base = self._base(((offset, length),))
        if length:
            _memset(base + offset, byte, length)

    def zero(self, *ranges: tuple[int, int]) -> None:
        """Zeroes several (offset, length) ranges with one base and size lookup."""
        base = self._base(ranges)
        for offset, length in ranges:
            if length:
                _memset(base + offset, 0, length)
