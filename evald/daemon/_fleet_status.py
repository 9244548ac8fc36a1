"""What a fleet daemon says about its store: whether it reaches it, whether the store went
back, whether its follower runs, and how long ago it last knew it was current.

Why one place: the store's health service (``evald.v1.Store``) and ``evald_store_connected``
must say NOT_SERVING for *every* reason the daemon may be serving an old revision, not only a
lost connection: a store whose revision went below the one applied (rewound, or written outside
evald: an alarm, never followed silently) and a follower that stopped. Each reason is a
condition of its own; health is SERVING only while none holds, so one clearing (the connection
back) never hides another (the rewind).

Freshness is what bounds revocation. Modules and limits stay fail-static (a daemon cut off from
the store serves what it has), but a token revoked while a daemon cannot hear it would be
accepted for as long as the outage lasts. So the daemon counts how long ago it last confirmed
that the revision it serves is the store's current one (``evald_store_revision_age_seconds``)
and, past ``[store] max_stale_s``, refuses its store tenants' evaluations with ``unavailable``
(the config's own tenants keep being served: their tokens do not come from the store).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["REWOUND", "STOPPED", "UNREACHABLE", "FleetStatus"]

#: The conditions, most serious first (the health message names the first that holds).
REWOUND: Final = "rewound"
STOPPED: Final = "stopped"
UNREACHABLE: Final = "unreachable"
_ORDER: Final = (REWOUND, STOPPED, UNREACHABLE)


class FleetStatus:
    """The store's conditions and freshness for one daemon (thread-safe).

    Parameters:
        publish: called with the health problem (None: SERVING) whenever it changes.
        registry: where the freshness metrics go (the daemon's).
        max_stale_s: past this age, store tenants are refused (0: never).
    """

    def __init__(
        self,
        publish: Callable[[str | None], None],
        registry: CollectorRegistry,
        max_stale_s: float,
    ) -> None:
        self._publish = publish
        self._lock = threading.Lock()
        self._conditions: dict[str, str] = {}
        self._published: str | None = None
        self.max_stale_s = max_stale_s
        self._confirmed: float | None = None  # monotonic time of the last confirmation
        #: Store tenants are served while ``time.monotonic()`` is at most this (one float
        #: compare on the evaluation path; inf: no bound).
        self.fresh_until = math.inf if max_stale_s <= 0 else -math.inf
        age = Gauge(
            "evald_store_revision_age_seconds",
            "Seconds since the daemon last confirmed that the revision it serves is the fleet "
            "store's current one (+Inf: never); past [store] max_stale_s its store tenants "
            "are refused.",
            registry=registry,
        )
        age.set_function(self.age)
        self.reads = Counter(
            "evald_store_reads",
            "Reads of the fleet store's changes (notifications are coalesced: one read per burst).",
            registry=registry,
        )

    # Conditions -----------------------------------------------------------------------------

    def set(self, condition: str, reason: str | None) -> None:
        """Sets (``reason``) or clears (None) one condition, and publishes the health."""
        with self._lock:
            if reason is None:
                self._conditions.pop(condition, None)
            else:
                self._conditions[condition] = reason
            problem = next((self._conditions[c] for c in _ORDER if c in self._conditions), None)
            changed = problem != self._published
            self._published = problem
        if changed:
            self._publish(problem)

    def holds(self, condition: str) -> bool:
        return condition in self._conditions

    @property
    def problem(self) -> str | None:
        """Why the store's health is NOT_SERVING (None: it is SERVING)."""
        return self._published

    # Freshness ------------------------------------------------------------------------------

    def confirm(self, at: float) -> None:
        """The revision served was the store's current one at monotonic time ``at`` (taken
        before the read that showed it, so the age never flatters)."""
        with self._lock:
            if self._confirmed is None or at > self._confirmed:
                self._confirmed = at
                if self.max_stale_s > 0:
                    self.fresh_until = at + self.max_stale_s

    def confirmed_ago(self, seconds: float) -> None:
        """A restart from the local cache: what it holds was confirmed ``seconds`` ago."""
        self.confirm(time.monotonic() - max(0.0, seconds))

    def age(self) -> float:
        """Seconds since the last confirmation (inf: never)."""
        confirmed = self._confirmed
        return math.inf if confirmed is None else max(0.0, time.monotonic() - confirmed)

    def stale(self) -> str | None:
        """Why store tenants are refused now (None: they are served)."""
        bound = self.max_stale_s
        if time.monotonic() <= self.fresh_until:
            return None
        age = self.age()
        said = "never" if math.isinf(age) else f"{age:.0f} s ago"
        return (
            f"the fleet store is stale: this daemon last confirmed its tenants and tokens "
            f"with the store {said}, over [store] max_stale_s = {bound:g} s, so a token "
            "revoked meanwhile could still be accepted; retry when the store is reachable"
        )
