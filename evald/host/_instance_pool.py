"""The kept instances: one per (pool key, module) in each thread, least recently used first out,
and a memory budget per pool key over every thread.

Instantiating costs tens of microseconds and a reused call a few, so each worker thread keeps
its instances in a thread-local ordered dict: as the last call left them (``reuse``), or put
back to a new instance's state after each call (``fresh``, :meth:`Instance.reset
<evald.host._instance.Instance.reset>`; the call path drops one it cannot put back). With the
pooling allocator each kept instance holds a slot; when none is free, the calling thread's
least recently used instances are dropped to make room (:class:`PoolExhausted
<evald.host._instance.PoolExhausted>` when it has none). The daemon passes the tenant
as pool key, so tenants never share an instance; a store is single-threaded, so threads never
do either. A trap or a malformed output discards the instance (the guest's shadow stack pointer
is not unwound). An instance made under another memory cap is adjusted in place when its memory
fits the new cap, else replaced.

What the kept instances hold is bounded twice (docs/design.md §5):

* per thread, at most ``instances_per_thread`` instances (the least recently used go);
* per pool key, every thread together, at most ``Limits.instance_cache_bytes`` of linear
  memory. An instance is charged its memory size when it is made and again whenever a call
  grows it; past the budget the key's other instances go, the calling thread's least recently
  used first, then other threads'; an instance over the budget on its own serves its call and
  is not kept.

Who pays for a re-instantiation: an instance that another pool key's instance pushed out of a
thread (its LRU, or a pooling slot it needed) is *displaced*; when its own key next needs it, the
CPU time of making it again is not that key's work, and the thread's
:meth:`InstancePool.take_uncharged_s` says how much of its last call was such time (the daemon's
scheduler leaves it out when it decides whether a tenant is heavy). An instance a key evicts
of its own (its LRU turning over its own modules, its memory budget) stays its own cost.

A module that is deleted or replaced leaves every thread at once (:meth:`InstancePool.forget`),
not only the thread that deleted it: an idle worker would otherwise keep its instances, and
their memory, until its LRU turned over.

Other threads' dicts are changed only under the pool's lock, and so are the owner's on every
path but the hit. The hit — the instance exists with this module and cap — is the hot path:
the call path (:mod:`evald.host._call_path`) tests it inline on :attr:`InstancePool.local`
and takes no lock; it tolerates the entry vanishing under it (another thread forgot the module
or evicted the instance meanwhile: the call still runs on the instance it holds, which is not
kept afterwards).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict

import wasmtime

from evald.host._deadline import EpochDeadlines
from evald.host._instance import Instance, PoolExhausted, instantiate
from evald.host._loaded_module import LoadedModule

__all__ = ["InstancePool", "ThreadInstances"]

#: One thread's instances by (pool key, module sha256), least recently used first.
ThreadInstances = OrderedDict[tuple[str, str], Instance]


class _ThreadToken:
    """Kept in a thread's local storage beside its instances: when the thread ends it is freed,
    and its finalizer returns the thread's instances to the pool's accounts."""

    __slots__ = ("__weakref__",)


class InstancePool:
    """Every thread's reused instances and what they hold per pool key; thread-safe.

    :meth:`instances`, :meth:`instance`, :meth:`discard` and :meth:`resized` act on the
    calling thread's instances; :meth:`forget` and :meth:`clear` on every thread's.
    """

    __slots__ = (
        "_deadlines",
        "_engine",
        "_fresh",
        "_held",
        "_lock",
        "_per_thread",
        "_threads",
        "local",
    )

    def __init__(
        self,
        engine: wasmtime.Engine,
        deadlines: EpochDeadlines,
        per_thread: int,
        *,
        fresh: bool = False,
    ) -> None:
        self._engine = engine
        #: Instances made for ``isolation = "fresh"`` (reset after each call, not reused as is).
        self._fresh = fresh
        self._deadlines = deadlines
        self._per_thread = per_thread
        #: ``local.instances`` is the calling thread's :data:`ThreadInstances` once it has any.
        self.local = threading.local()
        # Reentrant: a thread's finalizer may run while its own thread holds the lock.
        self._lock = threading.RLock()
        #: Every live thread's instances (the dicts themselves; a thread's leaves when it ends).
        self._threads: list[ThreadInstances] = []
        #: Bytes of linear memory the kept instances of each pool key hold, all threads.
        self._held: dict[str, int] = {}

    # -- the calling thread ----------------------------------------------------------------

    def instances(self) -> ThreadInstances:
        """The calling thread's instances (created empty on first use)."""
        instances: ThreadInstances | None = getattr(self.local, "instances", None)
        if instances is None:
            instances = OrderedDict()
            token = _ThreadToken()
            with self._lock:
                self._threads.append(instances)
            self.local.instances = instances
            self.local.token = token
            weakref.finalize(token, self._thread_ended, instances)
        return instances

    def instance(
        self,
        module: LoadedModule,
        memory_cap: int,
        fuel: int,
        deadline_ms: int,
        pool_key: str,
        budget_bytes: int,
    ) -> Instance:
        """This thread's instance of ``module`` for ``pool_key`` under ``memory_cap``, made
        (with ``fuel`` and ``deadline_ms`` for its start) when there is none, and kept within
        ``budget_bytes`` for the key (see the module docstring).

        Raises:
            Failure: from instantiation.
        """
        instances = self.instances()
        key = (pool_key, module.sha256)
        instance = instances.get(key)
        if instance is not None and instance.module is module:
            if instance.memory_cap == memory_cap:
                self._touch(instances, key)
                return instance
            if instance.memory.size() <= memory_cap:
                instance.store.set_limits(memory_size=memory_cap)
                instance.memory_cap = memory_cap
                self._touch(instances, key)
                return instance
        displaced = self._displaced()
        if displaced.pop(key, False):  # another key pushed it out: not this key's work
            began = time.thread_time()
            instance = self._instantiate(instances, key, module, memory_cap, fuel, deadline_ms)
            self.local.uncharged_s = (
                getattr(self.local, "uncharged_s", 0.0) + time.thread_time() - began
            )
        else:
            instance = self._instantiate(instances, key, module, memory_cap, fuel, deadline_ms)
        with self._lock:
            old = instances.get(key)
            if old is not None:
                self._remove(instances, key, old)
            instance.held_bytes = instance.view_size
            instances[key] = instance
            self._held[pool_key] = self._held.get(pool_key, 0) + instance.held_bytes
            while len(instances) > self._per_thread:
                oldest = next(iter(instances))
                self._push_out(instances, oldest, pool_key)
            self._within_budget(instances, key, instance, budget_bytes)
        return instance

    def take_uncharged_s(self) -> float:
        """CPU seconds this thread spent since the last call re-making instances that another
        pool key had pushed out (not their own key's work); resets the count."""
        local = self.local
        uncharged: float = getattr(local, "uncharged_s", 0.0)
        if uncharged:
            local.uncharged_s = 0.0
        return uncharged

    def _displaced(self) -> OrderedDict[tuple[str, str], bool]:
        """The calling thread's instances pushed out by another pool key (at most a few times
        ``instances_per_thread``, the oldest forgotten first)."""
        displaced: OrderedDict[tuple[str, str], bool] | None = getattr(
            self.local, "displaced", None
        )
        if displaced is None:
            displaced = self.local.displaced = OrderedDict()
        return displaced

    def _push_out(self, instances: ThreadInstances, victim: tuple[str, str], by: str) -> None:
        """Removes this thread's ``victim`` to make room for pool key ``by``; remembers it as
        displaced when it was another key's (caller holds the lock)."""
        self._remove(instances, victim, instances[victim])
        if victim[0] != by:
            displaced = self._displaced()
            displaced[victim] = True
            displaced.move_to_end(victim)
            while len(displaced) > 4 * self._per_thread:
                displaced.popitem(last=False)

    def _instantiate(
        self,
        instances: ThreadInstances,
        key: tuple[str, str],
        module: LoadedModule,
        memory_cap: int,
        fuel: int,
        deadline_ms: int,
    ) -> Instance:
        """A new instance; when the pooling allocator has no free slot, this thread's least
        recently used instances (``key``'s last) are dropped until one is free."""
        while True:
            try:
                return instantiate(
                    self._engine,
                    module,
                    memory_cap,
                    fuel,
                    self._deadlines.ticks(deadline_ms),
                    fresh=self._fresh,
                )
            except PoolExhausted:
                with self._lock:
                    victims = [k for k in instances if k != key] or [k for k in instances]
                    if not victims:
                        raise
                    self._push_out(instances, victims[0], key[0])

    def resized(self, instance: Instance, pool_key: str, budget_bytes: int) -> None:
        """Charges ``instance``'s memory as it is now (after a call grew it), if it is kept."""
        instances = self.instances()
        key = (pool_key, instance.module.sha256)
        with self._lock:
            if instances.get(key) is not instance:
                return  # not kept (forgotten or evicted meanwhile): nothing is charged for it
            grown = instance.view_size - instance.held_bytes
            instance.held_bytes = instance.view_size
            self._held[pool_key] = self._held.get(pool_key, 0) + grown
            self._within_budget(instances, key, instance, budget_bytes)

    def discard(self, instance: Instance, pool_key: str) -> None:
        """Drops ``instance`` if it is this thread's for ``pool_key`` (after a trap)."""
        instances = self.instances()
        key = (pool_key, instance.module.sha256)
        with self._lock:
            if instances.get(key) is instance:
                self._remove(instances, key, instance)

    # -- every thread ----------------------------------------------------------------------

    def forget(self, sha256: str) -> None:
        """Drops every thread's instances of the module with this hash, for every pool key."""
        with self._lock:
            for instances in self._threads:
                for key in [k for k in list(instances) if k[1] == sha256]:
                    self._remove(instances, key, instances[key])

    def clear(self) -> None:
        """Drops every thread's instances."""
        with self._lock:
            for instances in self._threads:
                instances.clear()
            self._held.clear()

    def held_bytes(self, pool_key: str) -> int:
        """The linear memory the kept instances of ``pool_key`` hold now, all threads."""
        with self._lock:
            return self._held.get(pool_key, 0)

    # -- accounts (caller holds the lock) ---------------------------------------------------

    @staticmethod
    def _touch(instances: ThreadInstances, key: tuple[str, str]) -> None:
        try:
            instances.move_to_end(key)
        except KeyError:  # another thread forgot or evicted it meanwhile
            pass

    def _remove(self, instances: ThreadInstances, key: tuple[str, str], instance: Instance) -> None:
        if instances.pop(key, None) is not None:
            left = self._held.get(key[0], 0) - instance.held_bytes
            if left > 0:
                self._held[key[0]] = left
            else:
                self._held.pop(key[0], None)

    def _within_budget(
        self,
        own: ThreadInstances,
        key: tuple[str, str],
        current: Instance,
        budget_bytes: int,
    ) -> None:
        """Evicts ``key``'s tenant's other instances until it holds at most ``budget_bytes``:
        this thread's least recently used first, then other threads'; ``current`` last."""
        pool_key = key[0]
        if self._held.get(pool_key, 0) <= budget_bytes:
            return
        for instances in (own, *(other for other in self._threads if other is not own)):
            for victim in [k for k in list(instances) if k[0] == pool_key and k != key]:
                self._remove(instances, victim, instances[victim])
                if self._held.get(pool_key, 0) <= budget_bytes:
                    return
        if own.get(key) is current:
            self._remove(own, key, current)  # over the budget on its own: serves this call only

    def _thread_ended(self, instances: ThreadInstances) -> None:
        with self._lock:
            for key, instance in list(instances.items()):
                self._remove(instances, key, instance)
            self._threads = [other for other in self._threads if other is not instances]
