"""How long an engine's scheduler thread may wait for a span's value: a small budget per step.

A request whose value is pending sits out the engine's steps (SGLang's jump scheduling, vLLM's
hold), so normally nothing waits. A row must still get a token in the rare step that was
already built when its span closed and in which nothing of the result region can be forced yet:
SGLang's overlap scheduler launches the next step before it reads the last one's tokens, and when
a request's result and error openers share no first character (``[`` / ``{``), or the token that
closed the span already held their shared prefix, there is no value-independent token to force.
Waiting there for the value holds every other sequence of the batch, whoever's they are: one
tenant's slow evaluator would freeze every stream of the server for up to a span deadline.

So such waits share one small budget per engine step (:data:`STEP_WAIT_BUDGET_S`, counted from
the first wait of the step, whatever the number of rows). A value that comes back inside it is
forced as usual (an evald round trip is well under a millisecond); past it, the span ends in
band now, ``<result_error>deadline_exceeded</result_error>`` with a message that says why, and
the batch goes on. The time a span waited is in its record (``waited_s``, the span log's
``waited_ms``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine_adapter.evaluation import SpanState

__all__ = ["STEP_WAIT_BUDGET_S", "StepWaits"]

#: What the waits of one engine step may add up to, however many rows wait in it.
STEP_WAIT_BUDGET_S = 0.005


class StepWaits:
    """The wait budget of one engine's steps (one scheduler thread).

    The engine calls :meth:`new_step` once per step, before the step's rows are filled; rows
    that must have a token call :meth:`settle`.
    """

    def __init__(
        self,
        budget_s: float = STEP_WAIT_BUDGET_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if budget_s < 0:
            raise ValueError(f"budget_s must not be negative, got {budget_s}")
        self.budget_s = budget_s
        self._clock = clock
        self._window_end: float | None = None
        self.waits = 0
        """Rows that had to wait for a value (counters for logs and tests)."""
        self.gave_up = 0
        """Spans ended in band because their value was not back within the step's budget."""

    def new_step(self) -> None:
        """A new step: its budget opens at its first wait."""
        self._window_end = None

    def settle(self, injector: SpanState) -> bool:
        """Waits for ``injector``'s pending value within what is left of the step's budget;
        if it is still unknown then, ends the span now with ``deadline_exceeded``.

        Returns:
            Whether there is something to force now (always, unless no span is pending).
        """
        if not injector.pending:
            return False
        if injector.forced_tokens():
            return True
        left = self.take_wait()
        if left > 0 and injector.wait(timeout_s=left):
            return True
        return self.end_in_band(injector)

    def take_wait(self) -> float:
        """Counts one row that must wait and returns what is left of the step's budget (its
        window opens now if this is the step's first wait)."""
        self.waits += 1
        now = self._clock()
        if self._window_end is None:
            self._window_end = now + self.budget_s
        return max(0.0, self._window_end - now)

    def end_in_band(self, injector: SpanState) -> bool:
        """After the wait: the known result is forced, or the span ends ``deadline_exceeded``
        now. Returns whether there is something to force."""
        if injector.result_known:  # the span deadline passed meanwhile: its error is forced
            return bool(injector.forced_tokens())
        self.gave_up += 1
        injector.give_up(
            f"the value was not back within the engine's step budget of "
            f"{self.budget_s * 1000:g} ms, and nothing of the result region could be forced "
            "while waiting (give the result and error openers a shared first character, as "
            "<result> and <result_error> have)"
        )
        return bool(injector.forced_tokens())
