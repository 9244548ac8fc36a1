"""The grammar side of one request, as the decode loop sees it.

In the grammar modes an XGrammar matcher masks the logits and an
:class:`~engine_adapter.Injector` follows the text, detects closed spans, submits them and queues
their results as forced tokens. Both see every token, the prefix's, the sampled and the forced
ones, so the matcher's state always matches the text in the model's context. In no-grammar mode
the base :class:`Constraint` allows every token and forces none, and the loop is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from engine_adapter.evaluation import SpanRecord, SpanState

__all__ = ["Constraint", "SpanConstraint"]


class Constraint:
    """No grammar: every token allowed, no spans, nothing forced."""

    def mask(self, logits: torch.Tensor) -> None:
        """Masks, in place, the logits of the tokens the grammar does not allow next."""

    def accept(self, token: int) -> bool:
        """Advances the grammar by ``token``; false (and no change) if it does not allow it."""
        return True

    def follow(self, token: int) -> None:
        """Shows an accepted token to the injector (which may close and submit a span)."""

    @property
    def pending(self) -> bool:
        """Whether a closed span's result is still to be forced."""
        return False

    def wait(self) -> None:
        """Blocks until the oldest pending result is ready or its deadline passes."""

    def take_forced(self) -> list[int]:
        """The queued result tokens, accepted by the grammar and the injector (empty: none
        ready)."""
        return []

    def terminated(self) -> bool:
        """Whether the grammar has ended the answer."""
        return False

    @property
    def span_count(self) -> int:
        """How many spans closed so far (``len(spans)`` without building the list)."""
        return 0

    @property
    def spans(self) -> Sequence[SpanRecord]:
        """Every span closed so far, oldest first."""
        return ()


class SpanConstraint(Constraint):
    """The span grammar's matcher plus the request's injector.

    Parameters:
        matcher: a fresh ``xgrammar.GrammarMatcher`` over the compiled span grammar.
        injector: this request's injector (without an evaluator it only records spans).
        bitmask: the engine's token bitmask buffer (one row of its vocabulary), reused by every
            request (the engine runs one at a time).
    """

    def __init__(self, matcher: Any, injector: SpanState, bitmask: Any) -> None:
        import xgrammar as xgr

        self._matcher = matcher
        self._injector = injector
        self._bitmask = bitmask
        self._apply_bitmask = xgr.apply_token_bitmask_inplace

    def mask(self, logits: torch.Tensor) -> None:
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._apply_bitmask(logits.unsqueeze(0), self._bitmask)

    def accept(self, token: int) -> bool:
        return bool(self._matcher.accept_token(token))

    def follow(self, token: int) -> None:
        self._injector.accept_token(token)

    @property
    def pending(self) -> bool:
        return bool(self._injector.pending)

    def wait(self) -> None:
        self._injector.wait()

    def take_forced(self) -> list[int]:
        """The queued result tokens, accepted by the grammar and the injector (empty: none
        ready).

        Raises:
            RuntimeError: the grammar refused a forced token; the injector promises
                grammar-legal tokens, so this is a defect, never a bad request.
        """
        forced = self._injector.forced_tokens()
        for token in forced:
            if not self._matcher.accept_token(token):
                raise RuntimeError(f"the grammar refused forced token {token}")
            self._injector.accept_token(token)
        return forced

    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    @property
    def span_count(self) -> int:
        return self._injector.span_count

    @property
    def spans(self) -> Sequence[SpanRecord]:
        return self._injector.spans
