"""The pools the daemon's tenants share, each with a share no other tenant can take.

Why shares: a pool with one daemon-wide cap (gRPC calls in flight, data-path connections) is a
resource one tenant can exhaust for all: 128 idle data-path connections of one tenant, well
within its own ``max_calls``, locked every other tenant out of the data path. So each tenant is
guaranteed ``capacity // tenants`` slots (at least one), and may borrow beyond that only from
what no tenant's guarantee still needs (:class:`SharedPool`). The capacity is a hard cap, what an
operator sizes memory by: with more tenants than slots, each may hold one while the pool has
room, and the pool never holds more than its capacity. Callers that have not
authenticated yet draw from a small pool of their own (:class:`Slots`), which tenants' slots
never come from, so no number of anonymous peers can take a tenant's place.

Both are plain thread-safe counters: the gRPC gatekeeper (on the event loop) and the data
path's threads take and give slots the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from evald.contract import ErrorCode, EvaldError

__all__ = ["SharedPool", "Slots"]


class SharedPool:
    """``capacity`` slots shared by ``tenants``, each guaranteed ``capacity // len(tenants)``.

    A tenant below its guarantee gets a slot whenever fewer than ``capacity`` are held; above
    it, it gets one only while the slots held plus the guarantees others have not used yet stay
    within ``capacity``. So whatever one tenant does, every other tenant can still take its
    guaranteed share, slots nobody needs are not wasted, and ``capacity`` is never exceeded: with
    more tenants than slots the guarantee (one) holds only while the pool has room, first come.

    Parameters:
        setting: the config key of the capacity, named in refusals.
        what: what a slot is, in refusals (``"gRPC calls"``, ``"data-path connections"``).
    """

    def __init__(self, capacity: int, tenants: Iterable[str], *, setting: str, what: str) -> None:
        names = list(tenants)
        self.capacity = capacity
        self.share = max(1, capacity // max(1, len(names)))
        self._setting = setting
        self._what = what
        self._lock = threading.Lock()
        self._held = dict.fromkeys(names, 0)
        self._total = 0  # slots held now, by all tenants
        self._active = set(names)
        # Slots held or guaranteed: the sum over tenants of max(held, share), plus what tenants
        # no longer sharing the pool still hold.
        self._committed = self.share * len(names)

    def set_tenants(self, tenants: Iterable[str]) -> None:
        """The tenants sharing the pool changed (a live reload, the fleet store): from now on
        each is guaranteed ``capacity // len(tenants)``; a tenant that left keeps what it holds,
        without a guarantee, until it gives it back."""
        names = list(tenants)
        with self._lock:
            self._active = set(names)
            for name in names:
                self._held.setdefault(name, 0)
            for name in [n for n, held in self._held.items() if n not in self._active]:
                if self._held[name] <= 0:
                    del self._held[name]
            self.share = max(1, self.capacity // max(1, len(names)))
            self._committed = sum(
                max(held, self.share) if name in self._active else held
                for name, held in self._held.items()
            )

    def take(self, tenant: str) -> None:
        """Takes one slot for ``tenant`` (any thread).

        Raises:
            EvaldError: ``quota_exceeded`` when the slot would come out of another tenant's
                guaranteed share.
        """
        with self._lock:
            held = self._held.get(tenant, 0)
            if self._total >= self.capacity:
                raise EvaldError(
                    ErrorCode.QUOTA_EXCEEDED,
                    f"the daemon holds all {self.capacity} {self._what} ({self._setting}), "
                    f"tenant {tenant!r} {held} of them; retry when some finish",
                )
            if held >= self.share or tenant not in self._active:
                if self._committed >= self.capacity:
                    raise EvaldError(
                        ErrorCode.QUOTA_EXCEEDED,
                        f"tenant {tenant!r} holds {held} {self._what}; past its share of "
                        f"{self.share} the rest of the daemon's {self.capacity} "
                        f"({self._setting}) is kept for other tenants; retry when some finish",
                    )
                self._committed += 1
            self._held[tenant] = held + 1
            self._total += 1

    def give(self, tenant: str) -> None:
        """Returns a slot :meth:`take` gave ``tenant`` (any thread)."""
        with self._lock:
            held = self._held.get(tenant, 0) - 1
            self._held[tenant] = held
            self._total -= 1
            if held >= self.share or tenant not in self._active:
                self._committed -= 1

    def held(self, tenant: str) -> int:
        return self._held.get(tenant, 0)


class Slots:
    """At most ``capacity`` of something at once, for callers with no tenant yet (thread-safe).

    Parameters:
        setting: the config key of the capacity, named in refusals.
        what: what a slot is, in refusals.
    """

    def __init__(self, capacity: int, *, setting: str, what: str) -> None:
        self.capacity = capacity
        self._setting = setting
        self._what = what
        self._lock = threading.Lock()
        self.held = 0

    def take(self) -> None:
        """Takes one slot.

        Raises:
            EvaldError: ``unavailable`` when all are taken (a retry later may succeed).
        """
        with self._lock:
            if self.held >= self.capacity:
                raise EvaldError(
                    ErrorCode.UNAVAILABLE,
                    f"the daemon already serves {self.held} {self._what} ({self._setting}); "
                    "retry shortly",
                )
            self.held += 1

    def give(self) -> None:
        with self._lock:
            self.held -= 1
