"""One span as it happened, the record an engine logs and the lab measures."""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_adapter.spans import EvalResult, SpanEvaluator
from evald.contract import ErrorCode

__all__ = ["SpanRecord", "deadline_at"]


def deadline_at(evaluator: SpanEvaluator | None, now: float, deadline_s: float) -> float:
    """When a span submitted ``now`` to ``evaluator`` is late: ``now + deadline_s``, or never
    (``inf``) for an evaluator that decides deadlines itself (``decides_deadlines``, see
    :class:`~engine_adapter.spans.SpanEvaluator`): its future then carries the deadline error,
    the same on every process that shares it."""
    if getattr(evaluator, "decides_deadlines", False):
        return math.inf
    return now + deadline_s


@dataclass(eq=False)
class SpanRecord:
    """One span as it happened: what the model wrote, what came back, and how long it took.

    Times are ``time.monotonic()`` seconds. ``result`` is ``None`` until the value is known (or
    the deadline passes); ``injected`` is the result text forced after the span.
    """

    evaluator: str
    content: str
    begin_offset: int
    """Byte offset of the span's opening string in the generated text."""
    closed_at_token: int
    """Number of tokens the sequence held when the span closed."""
    submitted_at: float
    deadline_at: float
    future: concurrent.futures.Future[EvalResult] | None = field(default=None, repr=False)
    result: EvalResult | None = None
    ready_at: float | None = None
    injected: str | None = None
    waited_s: float = 0.0
    """Time the engine spent blocked in :meth:`Injector.wait` for this span."""
    field: str | None = None
    """For a computed property: its JSON pointer in the document (``content`` is then the
    input built from the values it is computed from); ``None`` for a span."""
    diverged: bool = False
    """The sequence left the result region before it was complete (only possible without the
    grammar, or when an engine samples instead of forcing); nothing more was forced."""

    def outcome(self, now: float, deadline_ms: int) -> EvalResult | None:
        """The evaluation's answer once it came back, the deadline error once the deadline has
        passed (``now``), else None. Never blocks."""
        future = self.future
        if future is not None and future.done():
            try:
                return future.result()
            except Exception as exc:
                return EvalResult(None, ErrorCode.INTERNAL, f"evaluator failed: {exc}")
        if now >= self.deadline_at:
            return EvalResult(
                None,
                ErrorCode.DEADLINE_EXCEEDED,
                f"no value within the deadline of {deadline_ms} ms",
            )
        return None

    def block(
        self,
        evaluator: SpanEvaluator | None,
        clock: Callable[[], float],
        timeout_s: float | None,
    ) -> None:
        """Waits for the answer, at most until the deadline (or ``timeout_s``), after flushing
        ``evaluator`` (a submission must be on its way before anyone waits for it); the time
        spent is added to :attr:`waited_s`."""
        if self.result is not None:
            return
        if evaluator is not None:
            evaluator.flush()
        budget = self.deadline_at - clock()
        if timeout_s is not None:
            budget = min(budget, timeout_s)
        if budget > 0 and self.future is not None:
            started = clock()
            # An evaluator that decides deadlines completes the future by its deadline itself.
            concurrent.futures.wait([self.future], timeout=None if math.isinf(budget) else budget)
            self.waited_s += clock() - started

    @property
    def value(self) -> str | None:
        return self.result.value if self.result else None

    @property
    def error_code(self) -> str | None:
        return self.result.error_code if self.result else None

    @property
    def latency_ms(self) -> float | None:
        """Submit → value known, in milliseconds."""
        if self.ready_at is None:
            return None
        return (self.ready_at - self.submitted_at) * 1000.0
