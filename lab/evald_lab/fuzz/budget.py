"""The main loop's bookkeeping: how much of the budget is spent, and which class goes next.

A budget is either a count of inputs (each class gets its profile share of it) or seconds (every
class runs until the time is up). The next step belongs to the class furthest behind its share,
so the mix of classes holds whatever each step costs.
"""

from __future__ import annotations

import time

from evald_lab.fuzz.settings import FuzzSettings
from evald_lab.fuzz.tally import Recorder

__all__ = ["Budget"]


class Budget:
    """The main loop's budget over ``classes``, counted from the inputs recorded so far (the
    set-up's registrations and the hold scenarios are not part of it)."""

    def __init__(
        self, settings: FuzzSettings, recorder: Recorder, classes: tuple[str, ...]
    ) -> None:
        self.recorder = recorder
        self.classes = classes
        self.shares = settings.profile.shares
        self.seconds = settings.seconds
        self.deadline = (
            time.monotonic() + settings.seconds if settings.seconds is not None else None
        )
        self.quota = {c: settings.input_budget * self.shares[c] for c in classes}
        self.start_inputs = {c: recorder.classes[c].inputs for c in classes}
        self.started = time.monotonic()

    def active(self) -> set[str]:
        """The classes with budget left (all of them until the deadline, with seconds)."""
        if self.deadline is not None:
            return set(self.classes) if time.monotonic() < self.deadline else set()
        return {c for c in self.classes if self._spent(c) < self.quota[c]}

    def next_class(self, active: set[str]) -> str:
        """The active class furthest behind its share (by all its inputs so far)."""
        return min(active, key=lambda c: (self.recorder.classes[c].inputs + 1) / self.shares[c])

    def done_inputs(self) -> int:
        """Inputs the main loop has recorded."""
        return sum(self._spent(c) for c in self.classes)

    def completed(self) -> float:
        """Progress in the budget's unit: seconds or inputs."""
        if self.deadline is not None:
            return time.monotonic() - self.started
        return self.done_inputs()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def _spent(self, klass: str) -> int:
        return self.recorder.classes[klass].inputs - self.start_inputs[klass]
