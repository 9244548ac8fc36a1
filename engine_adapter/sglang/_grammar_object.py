"""``EvaluatorGrammar``: an SGLang grammar object that evaluates closed spans and forces results.

It wraps the real ``XGrammarGrammar`` compiled from the request's structural tag and follows the
order in which SGLang's scheduler calls grammar objects (``sglang==0.5.23``):

1. ``accept_token(t)`` for every token that entered the sequence, sampled or forced, after the
   step's results are processed. The wrapped matcher advances first (SGLang aborts the request
   if it refuses the token, as for any grammar); then the :class:`~engine_adapter.Injector`
   advances. When that closes a span, its evaluation is **submitted without blocking**.
2. The scheduler side (:mod:`engine_adapter.sglang._scheduling`) then takes the request out of
   the decode batch while its value is pending (:attr:`EvaluatorGrammar.wants_out`) and brings
   it back with the whole result region in one extend forward (:meth:`take_region`).
3. ``fill_vocab_mask(mask, row)`` for a step the request is part of. The row gets the grammar's
   own mask; while a span's result is being forced in a decode step (a step that was already
   launched when the span closed, with the overlap scheduler; or with jumping off), the row is
   narrowed to the next queued token with SGLang's token-filter op
   (``XGrammarGrammarBackend.set_token_filter``), so the sampler can only pick it. Only when
   nothing can be forced yet and the value is still pending does the call wait, within the
   step's small budget (``engine_adapter.serving._step_wait``): past it the span ends in band with
   ``<result_error>deadline_exceeded</result_error>``, so no other sequence of the batch waits
   for this one's value (``inline`` scheduling, kept for comparisons, waits up to the span's
   deadline). The first call in a step also flushes the engine-wide client.

Failures never abort a request: evald down, a timeout or an evaluator error become
``<result_error>CODE</result_error>`` in the text, and an internal fault of the adapter (logged)
only stops forcing for that request, leaving it to the plain grammar.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject
from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

from engine_adapter.evaluation import SpanRecord, SpanState, open_span_state
from engine_adapter.serving import AdapterRuntime, StepWaits, allows
from engine_adapter.sglang._rank_sync import rank_sync
from engine_adapter.spans import ComputedPlan, SpanBinding

__all__ = ["EvaluatorGrammar"]

logger = logging.getLogger("engine_adapter.sglang")


class EvaluatorGrammar(BaseGrammarObject):  # type: ignore[misc]
    """A grammar object that evaluates the spans of one request and forces their results.

    Parameters:
        grammar: the compiled grammar of the request (an ``XGrammarGrammar``); every call that
            is not about evaluation is delegated to it.
        bindings: the request's span kinds (``engine_adapter.spans.plan_spans``).
        runtime: the backend's shared state (codec, client, deadline).
        computed: for a JSON schema with computed properties
            (:mod:`engine_adapter.sglang._computed_json`), the plan the request's state follows
            (``bindings`` is then empty): the document's values are forced where spans' results
            would be, through the same calls.

    Thread-safety: like every SGLang grammar object, driven by one scheduler thread.
    """

    def __init__(
        self,
        grammar: Any,
        bindings: Sequence[SpanBinding],
        runtime: AdapterRuntime,
        computed: ComputedPlan | None = None,
    ) -> None:
        super().__init__()
        self.grammar = grammar
        self.grammar_stats = getattr(grammar, "grammar_stats", None)
        self._bindings = tuple(bindings)
        self._runtime = runtime
        self._computed = computed
        # The runtime is the engine-level runtime (codec, deadline, flush once per step) and,
        # for this tenant, where the spans go: with tensor parallelism, through the rank
        # exchange (rank 0 evaluates; every rank sees the same outcomes at the same step).
        self._sync = rank_sync()
        evaluator = runtime if self._sync is None else self._sync.evaluator(runtime)
        self._injector = open_span_state(
            runtime, self._bindings, evaluator, auto_flush=False, computed=computed
        )
        self._unfed_tail = 0
        """Tokens accepted after the grammar terminated (the matcher ignores them too)."""
        # A matcher terminates only by accepting one of its stop tokens, so the per-token path
        # asks it (a foreign call) only after such a token, and after a rollback.
        matcher = getattr(grammar, "matcher", None)
        stop_ids = getattr(matcher, "stop_token_ids", None)
        self._stop_ids: frozenset[int] | None = (
            frozenset(int(t) for t in stop_ids) if stop_ids is not None else None
        )
        self._terminated = bool(grammar.is_terminated())
        self._fault: str | None = None
        self._logged = 0
        self.forced_steps = 0
        """How many decode steps this request spent on a forced token (statistics)."""
        self.jumps = 0
        """How many result regions went into the sequence in one extend forward."""
        self._forwards: dict[int, int] = {}
        """Per span (its index), the forwards that carried its result tokens (the span log)."""
        self.step_waits: StepWaits | None = None
        """The step-wait budget of the scheduler whose steps the request is in, set by its
        :class:`~engine_adapter.sglang._scheduling.SpanScheduler` (``None`` with ``inline``
        scheduling: a step then waits for a value up to the span's deadline)."""

    # ------------------------------------------------------------------ SGLang's calls

    def accept_token(self, token: int) -> None:
        # The per-token path of every evaluated request on the scheduler thread: kept to the
        # matcher's own call plus the injector's (tests/engine_adapter/sglang/
        # bench_sglang_overhead.py measures it against a bare XGrammarGrammar).
        grammar = self.grammar
        if self._terminated:
            grammar.accept_token(token)
            self._unfed_tail += 1
            return
        grammar.accept_token(token)  # raises ValueError on a refused token, as SGLang expects
        stop_ids = self._stop_ids
        if stop_ids is None or token in stop_ids:
            self._terminated = bool(grammar.is_terminated())
        self.current_token = token
        if self._fault is None:
            try:
                self._injector.accept_token(token)
            except Exception as exc:
                self._stop(f"accept_token failed: {exc!r}")

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        self.grammar.fill_vocab_mask(vocab_mask, idx)
        if self._fault is not None:
            return
        try:
            self._runtime.flush()
            injector = self._injector
            if not injector.pending:  # free text: nothing to force, nothing to log yet
                if self._logged < injector.span_count:
                    self._log_finished_spans()
                return
            token = self._next_forced_token()
            if token is None:
                return
            if not allows(vocab_mask[idx], token):
                self._stop(f"the grammar refuses forced token {token}")
                return
            XGrammarGrammarBackend.set_token_filter(
                vocab_mask, [token], idx, is_allowed=True, reset_vocab_mask=True
            )
            self.forced_steps += 1
            span = injector.span_count - 1
            self._forwards[span] = self._forwards.get(span, 0) + 1
        except Exception as exc:
            self._stop(f"fill_vocab_mask failed: {exc!r}")

    def rollback(self, k: int) -> None:
        self.grammar.rollback(k)
        self._terminated = bool(self.grammar.is_terminated())
        dropped = min(k, self._unfed_tail)
        self._unfed_tail -= dropped
        if self._fault is None and k > dropped:
            try:
                self._injector.rollback(k - dropped)
            except Exception as exc:
                self._stop(f"rollback failed: {exc!r}")
        self._logged = min(self._logged, len(self._injector.spans))

    def is_terminated(self) -> bool:
        return self._terminated

    def copy(self) -> EvaluatorGrammar:
        """A fresh grammar object for another request (SGLang's ``copy`` resets the matcher)."""
        return EvaluatorGrammar(self.grammar.copy(), self._bindings, self._runtime, self._computed)

    def maybe_init_reasoning(self, reasoning: bool) -> None:
        self.grammar.maybe_init_reasoning(reasoning)

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: Any) -> torch.Tensor:
        mask: torch.Tensor = self.grammar.allocate_vocab_mask(vocab_size, batch_size, device)
        return mask

    def move_vocab_mask(self, vocab_mask: torch.Tensor, device: Any) -> torch.Tensor:
        moved: torch.Tensor = self.grammar.move_vocab_mask(vocab_mask, device)
        return moved

    def apply_vocab_mask(self, logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        self.grammar.apply_vocab_mask(logits=logits, vocab_mask=vocab_mask)

    def try_jump_forward(self, tokenizer: Any) -> None:
        """SGLang 0.5.23 never jumps forward; forced tokens go through ``fill_vocab_mask``."""
        return None

    # ------------------------------------------------------------------ the scheduler's calls

    @property
    def wants_out(self) -> bool:
        """A span closed and its result region is not in the sequence yet: the request should
        sit out decode steps (keeping its KV) until :attr:`ready_to_rejoin`."""
        return self._fault is None and self._injector.pending

    @property
    def ready_to_rejoin(self) -> bool:
        """The rest of the region is known (value, error or deadline), or there is nothing
        left to force (a fault stopped evaluation): :meth:`take_region` can run."""
        injector = self._injector
        return self._fault is not None or not injector.pending or injector.result_known

    def pending_future(self) -> Any:
        """The evaluation the request waits for, if any (the scheduler sleeps on it when no
        other request can run)."""
        spans = self._injector.spans
        if spans and spans[-1].result is None:
            return spans[-1].future
        return None

    def take_region(self, room: int) -> list[int]:
        """Accepts the rest of the current result region, at most ``room`` tokens, as if each had
        been sampled, and returns them: the caller appends them to the request's output ids and
        runs them in one extend forward.

        A token the grammar refuses stops evaluation for the request (logged; the tokens before
        it are rolled back), and nothing is returned.
        """
        if self._fault is not None or not self._injector.pending or room <= 0:
            return []
        try:
            tokens = self._injector.forced_tokens()[:room]
        except Exception as exc:
            self._stop(f"forced_tokens failed: {exc!r}")
            return []
        span = self._injector.span_count - 1
        accepted = 0
        try:
            for token in tokens:
                self.accept_token(token)
                if self._fault is not None:
                    raise RuntimeError(self._fault)
                accepted += 1
        except Exception as exc:
            if accepted:
                self.rollback(accepted)
            self._stop(f"the grammar refuses a forced token of the region ({exc!r})")
            return []
        if tokens:
            self.jumps += 1
            self._forwards[span] = self._forwards.get(span, 0) + 1
        self._log_finished_spans()
        return tokens

    # ------------------------------------------------------------------ what XGrammarGrammar has

    @property
    def ctx(self) -> Any:
        """The compiled grammar (``compile_framed_grammar`` embeds it in a reasoning frame)."""
        return self.grammar.ctx

    @property
    def key_string(self) -> Any:
        return getattr(self.grammar, "key_string", None)

    @property
    def evald_lowered_key(self) -> str | None:
        """The text the request's grammar was compiled from, after lowering with its tenant's
        evaluators (tensor-parallel ranks compare it: ``_rank_sync.agree_on_refusals``)."""
        key = self.key_string
        return key if isinstance(key, str) else None

    @property
    def bindings(self) -> tuple[SpanBinding, ...]:
        return self._bindings

    @property
    def runtime(self) -> AdapterRuntime:
        return self._runtime

    @property
    def computed(self) -> ComputedPlan | None:
        """The computed-properties plan of a JSON-schema request (None for spans)."""
        return self._computed

    @property
    def injector(self) -> SpanState:
        """The request's span state (text, spans, queue); for diagnostics and tests."""
        return self._injector

    @property
    def spans(self) -> list[SpanRecord]:
        return self._injector.spans

    @property
    def fault(self) -> str | None:
        """Why forcing stopped for this request, if it did."""
        return self._fault

    def __repr__(self) -> str:
        return (
            f"EvaluatorGrammar({self.key_string=}, spans={len(self._injector.spans)}, "
            f"forced_steps={self.forced_steps}, fault={self._fault!r})"
        )

    # ------------------------------------------------------------------ internals

    def _next_forced_token(self) -> int | None:
        injector = self._injector
        if not injector.pending:
            self._log_finished_spans()
            return None
        forced = injector.forced_tokens()
        if not forced:
            waits = self.step_waits
            if waits is None:  # ``inline`` scheduling, kept for comparisons: the step waits
                injector.wait()  # bounded by the span's deadline
            elif self._sync is not None:  # the same budget, one decision for every rank
                self._sync.settle(injector, waits, self.pending_future())
            else:  # a step already built when the span closed: a small budget, then in band
                waits.settle(injector)
            forced = injector.forced_tokens()
        self._log_finished_spans()
        return forced[0] if forced else None

    def _log_finished_spans(self) -> None:
        if self._runtime.config.span_log is None:
            return
        if self._sync is not None and not self._sync.is_leader:
            return  # one line per span: the rank that evaluated it writes it
        injector = self._injector
        spans = injector.spans
        # A span is logged once its region is complete (the last one may still be forced).
        done = len(spans) - (1 if injector.pending else 0)
        while self._logged < done and spans[self._logged].result is not None:
            self._runtime.log_span(
                spans[self._logged], forwards=self._forwards.get(self._logged, 0)
            )
            self._logged += 1

    def _stop(self, reason: str) -> None:
        self._fault = reason
        logger.error(
            "evald adapter: stopped evaluating spans for one request (%s); it continues under "
            "its grammar alone",
            reason,
        )
