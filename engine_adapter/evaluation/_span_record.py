"""One span as it happened, the record an engine logs and the lab measures."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

from engine_adapter.spans import EvalResult

__all__ = ["SpanRecord"]


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
