"""The path of one call: instance, input, fuel and deadline, the guest call, the result.

This is the product's hot path. A reused instance's call takes a few microseconds of CPU, so
every Python call, attribute lookup and allocation in :meth:`CallPath.run` shows: the common
case (the thread's kept instance, a value inside the output buffer) is written inline, and
everything rarer — a refused input, a new instance, a trap, a grown memory, an error payload, an
output to check — leaves it for a function of its own. What the call does, in order:

* checks the input against the limit and the guest's input buffer (the guest is not called);
* takes the thread's instance for (pool key, module) (:mod:`evald.host._instance_pool`); in
  ``fresh`` mode that instance is one that was put back to a new instance's state after its
  last call, or, for a module that cannot be put back, a new instance for this call alone;
* copies the input into the guest's input buffer through the memory view (no foreign call);
* gives the store the call's fuel (``Limits.fuel``; unmetered calls get more than any deadline
  allows) and an epoch deadline of ``deadline_ms`` worth of ticks, read right before the call;
* calls ``evald_eval`` through :mod:`evald.host._fastcall`, which releases the GIL: the daemon
  runs evaluations on worker threads, several at once;
* reads the fuel used, takes a new memory view if the call grew the memory, and reads the
  value, or the error payload (:func:`~evald.host._guest_output.read_output`), from the
  output buffer;
* in reuse mode zeroes what crossed the boundary (``Instance.clear_buffers``); in fresh mode
  puts the whole instance back (``Instance.reset``: every page the call wrote, by the kernel's
  account, back to the module's image, pages a grow added to zeros; the globals, the guest's
  memory size among them, when the next call enters), or drops it when it cannot; a trap or a
  malformed output discards the instance in either mode, and a call that grew the memory of a
  kept instance charges the growth to the pool key's budget (``Limits.instance_cache_bytes``).

Five foreign calls in all: fuel set and read, the epoch deadline, the guest call, the memory
size; a fresh call adds the reset's scan (one ``ioctl``) and a ``memset`` per written region.
"""

from __future__ import annotations

import logging
from typing import Final

import wasmtime

from evald.contract import ErrorCode
from evald.host._deadline import EpochDeadlines
from evald.host._guest_output import read_output
from evald.host._instance import Instance, instantiate
from evald.host._instance_pool import InstancePool, ThreadInstances
from evald.host._limits import HostConfig, Limits
from evald.host._loaded_module import LoadedModule
from evald.host._memory_reset import memory_reset_unavailable
from evald.host._outcome import Failure, call_trap_failure, first_line

__all__ = ["CallPath"]

_log = logging.getLogger("evald.host")

#: Fuel given to a call when ``Limits.fuel == 0`` (not metered): more than any deadline allows.
_UNMETERED_FUEL: Final = 2**63 - 1


class CallPath:
    """Runs inputs through loaded modules for one host; thread-safe (per-thread instances)."""

    __slots__ = (
        "_deadlines",
        "_engine",
        "_fresh",
        "_local",
        "_max_wasm_stack_bytes",
        "_pool",
        "_pool_memory_bytes",
        "_pooling",
        "_resets",
    )

    def __init__(
        self,
        engine: wasmtime.Engine,
        config: HostConfig,
        deadlines: EpochDeadlines,
        pool: InstancePool,
    ) -> None:
        self._engine = engine
        self._fresh = config.isolation == "fresh"
        #: Fresh instances are kept and reset after each call where the kernel can tell what a
        #: call wrote (:class:`~evald.host._memory_reset.MemoryReset`); else one per call.
        self._resets = self._fresh and not memory_reset_unavailable()
        if self._fresh and not self._resets:
            _log.warning(
                "fresh isolation makes a new instance for every call here (slower): %s",
                memory_reset_unavailable(),
            )
        #: With the pooling allocator, its slot size bounds every memory cap.
        self._pooling = config.pooling
        self._pool_memory_bytes = config.pool_memory_bytes
        self._max_wasm_stack_bytes = config.max_wasm_stack_bytes
        self._deadlines = deadlines
        self._pool = pool
        self._local = pool.local

    def memory_cap(self, limits: Limits) -> int:
        """The memory cap a module runs under with ``limits``: the tenant's ``memory_bytes``,
        bounded by the pool slot with the pooling allocator (:meth:`WasmHost.memory_cap
        <evald.host.WasmHost.memory_cap>` is this)."""
        if self._pooling:
            return min(limits.memory_bytes, self._pool_memory_bytes)
        return limits.memory_bytes

    def run(
        self, module: LoadedModule, data: bytes, limits: Limits, pool_key: str
    ) -> tuple[str, int]:
        """Runs ``module`` on ``data``; returns (value, fuel used). Each step is named in the
        module docstring; the common case of each stays here, its rare cases leave.

        Raises:
            Failure: for every guest error, trap and limit hit.
        """
        size = len(data)
        if size > limits.input_bytes or size > module.input_cap:
            raise _input_too_large(module, size, limits)
        fresh = self._fresh
        fuel = limits.fuel or _UNMETERED_FUEL
        memory_cap = self.memory_cap(limits)
        # The thread's kept instance for (pool key, module), looked up inline: the common case.
        instance: Instance | None = None
        if not fresh or (module.resettable and self._resets):
            try:
                instances: ThreadInstances = self._local.instances
            except AttributeError:
                instances = self._pool.instances()
            key = (pool_key, module.sha256)
            known = instances.get(key)
            if known is not None and known.module is module and known.memory_cap == memory_cap:
                try:
                    instances.move_to_end(key)
                except KeyError:  # another thread forgot or evicted it just now; still usable
                    pass
                instance = known
        if instance is None:
            instance = self._new_instance(module, limits, memory_cap, fuel, pool_key)
        context = instance.context
        if size:
            # in bounds: in_ptr + in_cap lies inside the memory (checked at instantiation),
            # memories never shrink, and size <= in_cap was checked above
            in_ptr = instance.in_ptr
            instance.view[in_ptr : in_ptr + size] = data
        context.set_fuel(fuel)
        # Computed once, right before the call (the ticker's lag is read here, not earlier).
        context.set_epoch_deadline(self._deadlines.ticks(limits.deadline_ms))
        try:
            result = instance.eval.call1(size)
        except (wasmtime.Trap, wasmtime.WasmtimeError) as exc:
            raise self._call_failed(exc, instance, limits, fuel, pool_key) from None
        used = fuel - context.fuel()
        if instance.memory.size() != instance.view_size:
            self._grown(instance, limits, pool_key)
        value: str | None = None
        if 0 <= result <= instance.out_cap and result <= limits.output_bytes:
            # The common case, inline: a value inside the output buffer, which lies inside the
            # memory (checked at instantiation). Anything else takes read_output's checks.
            out_ptr = instance.out_ptr
            try:
                value = str(instance.view[out_ptr : out_ptr + result], "utf-8")
            except UnicodeDecodeError:
                value = None
        if value is None:
            value = self._read_checked(instance, size, result, limits, used, pool_key)
        if not fresh:
            instance.clear_buffers(size, result)
        elif not instance.reset():
            self._pool.discard(instance, pool_key)  # not put back (or made for this call only)
        return value, used

    def _new_instance(
        self, module: LoadedModule, limits: Limits, memory_cap: int, fuel: int, pool_key: str
    ) -> Instance:
        """An instance for a call the thread keeps none for: from the pool (which keeps it), or
        in ``fresh`` mode for a module that cannot be put back, a new one for this call alone."""
        if self._fresh and (not module.resettable or not self._resets):
            # nothing to reset this module's instances with: a new one for this call only
            return instantiate(
                self._engine, module, memory_cap, fuel, self._deadlines.ticks(limits.deadline_ms)
            )
        return self._pool.instance(
            module, memory_cap, fuel, limits.deadline_ms, pool_key, limits.instance_cache_bytes
        )

    def _call_failed(
        self,
        exc: wasmtime.Trap | wasmtime.WasmtimeError,
        instance: Instance,
        limits: Limits,
        fuel: int,
        pool_key: str,
    ) -> Failure:
        """The failure of a guest call that trapped (or that wasmtime failed); the instance is
        discarded either way."""
        if not isinstance(exc, wasmtime.Trap):
            self._pool.discard(instance, pool_key)
            return Failure(ErrorCode.INTERNAL, f"wasmtime failed the call: {first_line(exc)}")
        used = fuel - instance.context.fuel()
        self._pool.discard(instance, pool_key)
        return call_trap_failure(
            exc,
            evaluator=instance.module.manifest.name,
            limits=limits,
            fuel_used=used,
            max_wasm_stack_bytes=self._max_wasm_stack_bytes,
            memory_cap=instance.memory_cap,
            grow_was_refused=instance.grow_was_refused,
        )

    def _grown(self, instance: Instance, limits: Limits, pool_key: str) -> None:
        """The guest grew its memory: a new view (the old one may be stale), and the growth
        charged to the pool key's budget if the instance is kept (in fresh mode too: the reset
        keeps the grown pages, zeroed, for the next call)."""
        instance.refresh_view()
        self._pool.resized(instance, pool_key, limits.instance_cache_bytes)

    def _read_checked(
        self, instance: Instance, size: int, result: int, limits: Limits, used: int, pool_key: str
    ) -> str:
        """The value by :func:`~evald.host._guest_output.read_output`'s checks (an error payload,
        an output past a bound, text that is not UTF-8); on its failure the instance is
        discarded (a guest fault) or put back as a call's end would."""
        try:
            return read_output(instance, result, limits, used)
        except Failure as failure:
            if failure.code is ErrorCode.GUEST_FAULT:
                self._pool.discard(instance, pool_key)
            elif not self._fresh:
                instance.clear_buffers(size, result)
            elif not instance.reset():
                self._pool.discard(instance, pool_key)
            raise


def _input_too_large(module: LoadedModule, size: int, limits: Limits) -> Failure:
    """Why an input of ``size`` bytes is refused before the guest is called."""
    if size > limits.input_bytes:
        return Failure(
            ErrorCode.INPUT_TOO_LARGE,
            f"the input is {size} bytes; the limit is {limits.input_bytes} bytes (input_bytes)",
        )
    return Failure(
        ErrorCode.INPUT_TOO_LARGE,
        f"the input is {size} bytes; evaluator {module.manifest.name} "
        f"accepts at most {module.input_cap} bytes",
    )
