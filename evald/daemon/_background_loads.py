"""A store's evaluators loaded off the control thread, each served once its load is done.

A store that changes under a running daemon (the fleet store) learns of a new module on the
control thread, where tenants and tokens apply; compiling it there held every revocation behind
the compile. So each evaluator to load is started once on the module thread
(:attr:`~evald.daemon._registry.Registry.schedule`) and, when done, handed back to the control
thread: kept until the store's next look at its tenant takes it (:meth:`BackgroundLoads.take`),
or remembered as failed until the store touches its tenant again (:meth:`BackgroundLoads.retry`).
While any is pending its tenant is *loading* in the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from evald.contract import EvaldError
from evald.daemon._registry import Evaluator, Registry

__all__ = ["BackgroundLoads", "LoadKey", "StillLoading"]

#: ``(tenant, evaluator name, module hash)``.
LoadKey = tuple[str, str, str]


class StillLoading(Exception):
    """The evaluator is being loaded on the module thread: not served yet."""


class BackgroundLoads:
    """Evaluators being loaded, loaded and not yet served, or failed (control thread only).

    Parameters:
        registry: whose :attr:`~evald.daemon._registry.Registry.schedule` runs the loads, and
            whose tenants are *loading* while theirs are pending.
        wanted: whether the store still wants ``key`` (a load that finished after its
            evaluator was replaced or removed is dropped, and ``drop`` called with it).
        drop: releases a loaded evaluator nobody will serve.
    """

    def __init__(
        self,
        registry: Registry,
        *,
        wanted: Callable[[LoadKey], bool],
        drop: Callable[[Evaluator], None],
    ) -> None:
        self._registry = registry
        self._wanted = wanted
        self._drop = drop
        self._pending: set[LoadKey] = set()
        self._ready: dict[LoadKey, Evaluator] = {}
        self._failed: dict[LoadKey, EvaldError] = {}

    @property
    def pending(self) -> bool:
        """Whether any load is still running."""
        return bool(self._pending)

    def take(
        self, key: LoadKey, load: Callable[[], Evaluator], then: Callable[[str], None]
    ) -> Evaluator:
        """The evaluator ``key`` if loaded; else its ``load`` starts on the module thread
        (once), and ``then(tenant)`` runs on the control thread when it is done.

        Raises:
            StillLoading: it is being loaded.
            EvaldError: why it did not load (until :meth:`retry` forgets it).
        """
        ready = self._ready.pop(key, None)
        if ready is not None:
            return ready
        failed = self._failed.get(key)
        if failed is not None:
            raise failed
        schedule = self._registry.schedule
        if schedule is None:
            return load()
        if key not in self._pending:
            self._pending.add(key)
            self._registry.loading(key[0], +1)
            schedule(lambda: _attempt(load), lambda result: self._done(key, result, then))
        raise StillLoading(key[1])

    def retry(self, tenants: Iterable[str]) -> None:
        """Forgets the failures of ``tenants``: their loads are tried again when next taken."""
        tenants = set(tenants)
        self._failed = {key: e for key, e in self._failed.items() if key[0] not in tenants}

    def _done(
        self, key: LoadKey, result: Evaluator | EvaldError, then: Callable[[str], None]
    ) -> None:
        self._pending.discard(key)
        self._registry.loading(key[0], -1)
        if not self._wanted(key):
            if isinstance(result, Evaluator):
                self._drop(result)
        elif isinstance(result, EvaldError):
            self._failed[key] = result
        else:
            self._ready[key] = result
        then(key[0])


def _attempt(load: Callable[[], Evaluator]) -> Evaluator | EvaldError:
    try:
        return load()
    except EvaldError as exc:
        return exc
