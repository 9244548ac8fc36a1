"""Reuse mode's instances: one per (pool key, module) in each thread, least recently used first
out.

Instantiating costs tens of microseconds and a reused call a few, so in ``reuse`` mode each
worker thread keeps its instances in a thread-local ordered dict. The daemon passes the tenant
as pool key, so tenants never share an instance; a store is single-threaded, so threads never
do either, and no lock is taken. A trap or a malformed output discards the instance (the
guest's shadow stack pointer is not unwound). An instance made under another memory cap is
adjusted in place when its memory fits the new cap, else replaced.

The hit — the instance exists with this module and cap — is the hot path, and the call path
(:mod:`evald.host._call_path`) tests it inline on :attr:`InstancePool.local`; everything else
goes through :meth:`InstancePool.instance`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import wasmtime

from evald.host._deadline import EpochDeadlines
from evald.host._instance import Instance, instantiate
from evald.host._loaded_module import LoadedModule

__all__ = ["InstancePool", "ThreadInstances"]

#: One thread's instances by (pool key, module sha256), least recently used first.
ThreadInstances = OrderedDict[tuple[str, str], Instance]


class InstancePool:
    """Each thread's reused instances; every method acts on the calling thread's only."""

    __slots__ = ("_deadlines", "_engine", "_per_thread", "local")

    def __init__(self, engine: wasmtime.Engine, deadlines: EpochDeadlines, per_thread: int) -> None:
        self._engine = engine
        self._deadlines = deadlines
        self._per_thread = per_thread
        #: ``local.instances`` is the calling thread's :data:`ThreadInstances` once it has any.
        self.local = threading.local()

    def instances(self) -> ThreadInstances:
        """The calling thread's instances (created empty on first use)."""
        instances: ThreadInstances | None = getattr(self.local, "instances", None)
        if instances is None:
            instances = OrderedDict()
            self.local.instances = instances
        return instances

    def instance(
        self, module: LoadedModule, memory_cap: int, fuel: int, deadline_ms: int, pool_key: str
    ) -> Instance:
        """This thread's instance of ``module`` for ``pool_key`` under ``memory_cap``, made
        (with ``fuel`` and ``deadline_ms`` for its start) when there is none.

        Raises:
            Failure: from instantiation.
        """
        instances = self.instances()
        key = (pool_key, module.sha256)
        instance = instances.get(key)
        if instance is not None and instance.module is module:
            if instance.memory_cap != memory_cap:
                if instance.memory.size() > memory_cap:
                    del instances[key]
                    return self.instance(module, memory_cap, fuel, deadline_ms, pool_key)
                instance.store.set_limits(memory_size=memory_cap)
                instance.memory_cap = memory_cap
            instances.move_to_end(key)
            return instance
        instance = instantiate(
            self._engine, module, memory_cap, fuel, self._deadlines.ticks(deadline_ms)
        )
        instances[key] = instance
        while len(instances) > self._per_thread:
            instances.popitem(last=False)
        return instance

    def discard(self, instance: Instance, pool_key: str) -> None:
        """Drops ``instance`` if it is this thread's for ``pool_key`` (after a trap)."""
        instances = self.instances()
        key = (pool_key, instance.module.sha256)
        if instances.get(key) is instance:
            del instances[key]

    def forget(self, sha256: str) -> None:
        """Drops this thread's instances of the module with this hash, for every pool key."""
        instances = self.instances()
        for key in [k for k in instances if k[1] == sha256]:
            del instances[key]

    def clear(self) -> None:
        """Drops all of this thread's instances."""
        self.instances().clear()
