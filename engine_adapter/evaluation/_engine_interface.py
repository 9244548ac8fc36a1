"""What an engine must provide and call to have spans evaluated: two interfaces, written down.

The split is the one vLLM (``v1/structured_output/backend_types.py``: an engine-level backend
and a per-request grammar) and SGLang (``srt/constrained/base_grammar_backend.py``) write down
for grammars:

- :class:`EngineRuntime`, what every evaluated request of one engine shares: the tokenizer's
  codec, the span deadline, and the flush that sends a decode step's submissions at once.
  SGLang's is ``engine_adapter.serving.AdapterRuntime`` (one per grammar backend, and one per
  tenant), vLLM's the scheduler's ``SpanTracker``, the local engine's the ``LocalEngine``.
  Where a request's spans are evaluated is the request's own (its tenant's runtime, or the
  local engine's evaluator for that call), so it is named when a span state is opened.
- :class:`SpanState`, one request's spans as its decode loop drives them (the
  :class:`~engine_adapter.evaluation.Injector` implements it). Every engine opens it with
  :func:`open_span_state`, so the three engines hold their requests' spans the same way
  (SGLang inside its grammar object, vLLM in the scheduler's tracker, the local engine in its
  constraint).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine_adapter.evaluation._computed_state import ComputedFieldsState
from engine_adapter.evaluation._injector import Injector
from engine_adapter.evaluation._span_record import SpanRecord
from engine_adapter.evaluation._token_codec import TokenCodec
from engine_adapter.spans import ComputedPlan, SpanBinding, SpanEvaluator

__all__ = ["EngineRuntime", "SpanState", "open_span_state"]


class EngineRuntime(Protocol):
    """What all evaluated requests of one engine share (one per tenant in a server process).

    Built once, before the first evaluated request, on any thread; read from the threads that
    open span states (SGLang's grammar-compile pool, vLLM's and the local engine's decode
    thread). :meth:`flush` is called from the decode thread only.
    """

    @property
    def codec(self) -> TokenCodec:
        """The tokenizer's bytes; the vocabulary must be the grammar bitmask's."""
        ...

    @property
    def deadline_ms(self) -> int:
        """Per span, from its closing until its value must be known (then it is an error)."""
        ...

    def flush(self) -> None:
        """Sends every span submitted since the last flush as one message. An engine that
        batches requests calls it once per decode step, after the step's last
        ``SpanState.accept_token``; one that does not opens its states with ``auto_flush``."""
        ...


class SpanState(Protocol):
    """One request's spans as its engine drives them, from the request's one decode thread.

    The loop, per step (the evaluations complete on other threads; the state only reads their
    futures)::

        accept_token(t)       # every token that enters the sequence, sampled or forced, in order
        forced_tokens()       # before sampling: the result tokens to force now (may be several)
        pending               # a span closed and its region is not complete: do not sample;
        wait(timeout_s)       #   block for the value (bounded by the span's deadline), or
        give_up(message)      #   end the span in band when the engine cannot wait any longer
        rollback(n)           # the engine dropped its last n tokens (rejected drafts, retract)
        spans                 # the records, for logs and results
    """

    def accept_token(self, token_id: int) -> None:
        """Records one token that entered the sequence (may close and submit a span)."""
        ...

    def forced_tokens(self) -> list[int]:
        """The tokens to force next (empty: sample, or wait while :attr:`pending`)."""
        ...

    def draft_limit(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (a speculative draft) may enter before a span closes."""
        ...

    @property
    def pending(self) -> bool:
        """A span closed and its result region is not complete: the engine must not sample."""
        ...

    @property
    def result_known(self) -> bool:
        """The pending span's result is decided: :meth:`forced_tokens` spans its region."""
        ...

    @property
    def span_count(self) -> int:
        """How many spans closed in the current sequence."""
        ...

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until the pending value is known, its deadline passes, or ``timeout_s``."""
        ...

    def give_up(self, message: str) -> None:
        """Ends the pending span in band (``deadline_exceeded``) without its value."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last ``num_tokens`` accepted tokens, spans included."""
        ...

    @property
    def spans(self) -> list[SpanRecord]:
        """Every span that closed in the current sequence, in order."""
        ...


def open_span_state(
    runtime: EngineRuntime,
    bindings: Sequence[SpanBinding],
    evaluator: SpanEvaluator | None,
    *,
    auto_flush: bool = True,
    computed: ComputedPlan | None = None,
) -> SpanState:
    """A new request's span state, with ``runtime``'s codec and deadline; its spans go to
    ``evaluator`` (``None`` records spans without evaluating or forcing anything).

    ``auto_flush=False`` for an engine that flushes once per decode step itself
    (:meth:`EngineRuntime.flush`); the state still flushes before it blocks in ``wait``.

    ``computed``: the request is a JSON document with computed properties
    (``SpanGrammar.computed``); its state follows the document instead of spans
    (:class:`ComputedFieldsState`, docs/computed-fields.md) and ``bindings`` is empty.

    Raises:
        ValueError: bindings the text scanner cannot tell apart.
    """
    if computed is not None:
        return ComputedFieldsState(
            runtime.codec,
            computed,
            evaluator,
            deadline_ms=runtime.deadline_ms,
            auto_flush=auto_flush,
        )
    return Injector(
        runtime.codec,
        bindings,
        evaluator,
        deadline_ms=runtime.deadline_ms,
        auto_flush=auto_flush,
    )
