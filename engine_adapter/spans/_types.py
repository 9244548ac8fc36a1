"""The narrow types shared by the span grammar, the injector, the evaluator clients and engines.

Engines (SGLang, the local CPU engine) see only these and :class:`engine_adapter.Injector`;
nothing here knows about a particular engine or transport.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Protocol

__all__ = ["EvalResult", "SpanBinding", "SpanEvaluator"]


@dataclass(frozen=True)
class SpanBinding:
    """One kind of evaluated span: where it opens and closes, and which evaluator answers it."""

    evaluator: str
    begin: str
    end: str
    result_begin: str = "<result>"
    result_end: str = "</result>"
    error_begin: str = "<result_error>"
    error_end: str = "</result_error>"
    result_regex: str | None = None
    """The evaluator's ``result_regex``: a value that does not match it is replaced by a
    ``guest_fault`` error before forcing, since the grammar would refuse its tokens."""


@dataclass(frozen=True)
class EvalResult:
    """The answer to one span: a value, or an error code (``evald.contract.ErrorCode``
    value)."""

    value: str | None
    error_code: str | None = None
    message: str = ""
    fuel_used: int = 0
    eval_time_us: int = 0


class SpanEvaluator(Protocol):
    """Evaluates span contents without blocking the caller.

    Implementations: the evald stream client, the in-process WASM host, the Python reference.
    ``submit`` must return at once; the future always completes (with an error result on
    failure, never an exception) no later than ``deadline_ms`` plus a small margin.

    An evaluator whose answers must be the same on several engine processes (SGLang's tensor
    parallel ranks, ``engine_adapter.sglang._rank_sync``) sets ``decides_deadlines = True``: it
    completes a late span's future with ``deadline_exceeded`` itself, and span states then never
    end a span by their own process's clock.
    """

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]: ...

    def flush(self) -> None:
        """Sends everything submitted since the last flush as one message (once per step)."""
        ...
