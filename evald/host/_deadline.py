"""A call's wall-clock deadline as an epoch deadline, and the ticker that makes it hold.

wasmtime stops a guest when the engine's epoch passes the store's deadline, counted in epoch
increments ("ticks"). :class:`EpochDeadlines` owns the :class:`~evald.host._engine.EpochTicker`
that increments the epoch every ``epoch_tick_ms`` and turns ``deadline_ms`` into ticks for
every store the host sets up: each call, each new instance, each trial at load. With
``epoch_tick_ms = 0`` there is no ticker; tests advance the epoch by hand and a tick counts as
1 ms.
"""

from __future__ import annotations

import math

import wasmtime

from evald.host._engine import EpochTicker

__all__ = ["EpochDeadlines"]


class EpochDeadlines:
    """Deadlines in epoch ticks for one engine; thread-safe (the cache holds immutable ints)."""

    __slots__ = ("_ticks_for_ms", "tick_ms", "ticker")

    def __init__(self, engine: wasmtime.Engine, epoch_tick_ms: float) -> None:
        self.ticker = EpochTicker(engine, epoch_tick_ms) if epoch_tick_ms > 0 else None
        self.tick_ms = epoch_tick_ms if epoch_tick_ms > 0 else 1.0
        self._ticks_for_ms: dict[int, int] = {}

    def ticks(self, deadline_ms: int) -> int:
        """Epoch ticks from now until ``deadline_ms`` of wall-clock time has passed.

        The ticker may lag (a starved thread catches up in a burst); the deadline is set past
        the lag, so a burst never cuts a call short: it ends no earlier than ``deadline_ms``.
        Read right before the store's deadline is set, so the lag is current.
        """
        ticks = self._ticks_for_ms.get(deadline_ms)
        if ticks is None:
            ticks = max(1, math.ceil(deadline_ms / self.tick_ms))
            self._ticks_for_ms[deadline_ms] = ticks
        return ticks + (self.ticker.lag_ticks() if self.ticker is not None else 0)

    def stop(self) -> None:
        """Stops the ticker thread, if any (idempotent)."""
        if self.ticker is not None:
            self.ticker.stop()
