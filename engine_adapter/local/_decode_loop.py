"""The decode loop of one request: prefill, then steps until a stop rule fires.

One step: mask the logits with the grammar, sample, accept the token into the grammar and the
:class:`~engine_adapter.Injector`; when the injector has forced tokens queued (a span closed and
its result is ready), accept them too and run the sampled token **and all forced tokens in one
forward**, so the KV cache holds the injected result exactly as if the model had written it, at
the cost of one decode step. SGLang cannot do that yet (each forced token is a step there); this
engine shows the floor. Then the stop rules: the grammar ended the answer, or a stop string
appeared.

The loop is the same in every mode (:class:`~engine_adapter.local._constraint.Constraint` is the
grammar side, none in no-grammar mode) and on every runtime (only the
:class:`~engine_adapter.local.Backend` touches the model). Its timings are taken at named points
by a :class:`~engine_adapter.local._timing.GenerationClock`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_adapter.local._detokenizer import Detokenizer
from engine_adapter.local._result import SpanTiming, StepTiming, TextCallback

if TYPE_CHECKING:
    import torch

    from engine_adapter.local._backend import Backend
    from engine_adapter.local._constraint import Constraint
    from engine_adapter.local._sampling import Sampler
    from engine_adapter.local._timing import GenerationClock

__all__ = ["DecodeLoop", "Decoded"]


@dataclass(frozen=True)
class Decoded:
    """What the loop produced (the engine adds the request's description and the timings)."""

    text: str
    token_ids: list[int]
    n_sampled: int
    n_forced: int
    """Injected result tokens (the prefix is not counted here)."""
    stop_reason: str
    spans: list[SpanTiming]


class DecodeLoop:
    """Decodes one request over a backend whose KV cache it may reuse.

    Parameters:
        backend: the model runtime; the loop extends (and for the prefill, truncates) its cache.
        tokenizer: decodes the answer for the text and the streaming callback.
        constraint: the request's grammar side, already past the prefix's tokens.
        sampler: the request's sampler.
        clock: the request's clock; the loop marks its phases.
        on_text: streaming callback (``None``: no streaming).
    """

    def __init__(
        self,
        backend: Backend,
        tokenizer: Any,
        constraint: Constraint,
        sampler: Sampler,
        clock: GenerationClock,
        on_text: TextCallback | None,
    ) -> None:
        self._backend = backend
        self._eos = backend.eos_token_id
        self._constraint = constraint
        self._sampler = sampler
        self._clock = clock
        self._on_text = on_text
        self._detok = Detokenizer(tokenizer)
        self._logits: torch.Tensor  # set by prefill
        self._prefix_chars = 0
        self._n_sampled = 0
        self._n_forced = 0
        self._spans: list[SpanTiming] = []

    def prefill(self, prompt_ids: Sequence[int], prefix_ids: Sequence[int]) -> int:
        """Forwards the prompt and the forced prefix, reusing the longest prefix the KV cache
        already holds (at least one token is forwarded, to get logits); streams the prefix.

        Returns:
            How many cached positions were reused.
        """
        full = [*prompt_ids, *prefix_ids]
        reuse = min(_common_prefix_len(self._backend.tokens, full), len(full) - 1)
        with self._clock.prefill:
            self._backend.truncate(reuse)
            self._logits = self._backend.forward(full[reuse:])
        self._clock.prefilled(len(full) - reuse)
        self._emit(prefix_ids, forced=True)
        self._prefix_chars = len(self._detok.emitted)
        return reuse

    def run(self, max_new_tokens: int, stop: Sequence[str]) -> Decoded:
        """Decodes after :meth:`prefill` until a stop rule fires (``max_new_tokens`` counts
        sampled tokens only, so a result being injected is always completed)."""
        self._clock.decode_started()
        stop_reason = "max_new_tokens"
        while self._n_sampled < max_new_tokens:
            reason = self._step(stop)
            if reason is not None:
                stop_reason = reason
                break
        text, tail = self._detok.finish()
        if tail and self._on_text is not None:
            self._on_text(tail, False)
        return Decoded(
            text=text,
            token_ids=list(self._detok.ids),
            n_sampled=self._n_sampled,
            n_forced=self._n_forced,
            stop_reason=stop_reason,
            spans=self._spans,
        )

    def _step(self, stop: Sequence[str]) -> str | None:
        """One step: mask, sample, accept, force the queued results, forward, the stop rules.

        Returns:
            Why decoding stops (``grammar``, ``eos``, ``context``, ``stop``), or ``None`` to go
            on.
        """
        clock = self._clock.step
        clock.start()
        with clock.mask:
            self._constraint.mask(self._logits)
        with clock.sample:
            token = self._sampler.next_token(self._logits)
        if token is None:
            return "grammar"
        self._n_sampled += 1
        with clock.accept:
            if not self._constraint.accept(token):
                # Cannot happen with a correct mask; stop rather than emit an illegal token.
                return "grammar"
            if token == self._eos:
                return "eos"
            self._constraint.follow(token)
        self._emit([token], forced=False)
        forced = self._queued_results()
        if self._backend.n_tokens + 1 + len(forced) > self._backend.n_ctx:
            return "context"
        with clock.forward:
            self._logits = self._backend.forward([token, *forced])
        timing = self._clock.step_done("inject" if forced else "sample", 1 + len(forced))
        forced_at = self._emit_forced(forced)
        self._record_new_spans(timing, len(forced), forced_at)
        if self._constraint.terminated():
            return "eos"
        if stop and _contains_stop(self._detok.emitted, stop, self._prefix_chars):
            return "stop"
        return None

    def _queued_results(self) -> list[int]:
        """The forced tokens of every result ready now, to go into the next forward.

        The value is awaited first (bounded by the span deadline) so that the whole result text
        is tokenized canonically in one piece rather than as ``<result`` + the rest.
        """
        forced: list[int] = []
        while self._constraint.pending:
            with self._clock.step.wait:
                self._constraint.wait()
            more = self._constraint.take_forced()
            if not more:
                break
            forced.extend(more)
        return forced

    def _emit(self, ids: Sequence[int], *, forced: bool) -> None:
        text = self._detok.push(ids)
        if text and self._on_text is not None:
            self._on_text(text, forced)

    def _emit_forced(self, forced: list[int]) -> int:
        """Adds the forced tokens to the answer; returns the index of the first (-1: none)."""
        if not forced:
            return -1
        self._n_forced += len(forced)
        forced_at = len(self._detok.ids)
        self._emit(forced, forced=True)
        return forced_at

    def _record_new_spans(self, timing: StepTiming, n_forced: int, forced_at: int) -> None:
        """Records the spans that closed in this step, with the step's wait and forward."""
        if self._constraint.span_count <= len(self._spans):
            return
        for record in self._constraint.spans[len(self._spans) :]:
            self._spans.append(
                SpanTiming(
                    evaluator=record.evaluator,
                    content=record.content,
                    forced_text=record.injected or "",
                    value=record.value,
                    error_code=record.error_code,
                    n_forced_tokens=n_forced,
                    wait_us=timing.wait_us,
                    eval_latency_us=int((record.latency_ms or 0.0) * 1000),
                    inject_forward_us=timing.forward_us if n_forced else 0,
                    step=self._n_sampled,
                    forced_at=forced_at,
                    field=record.field,
                )
            )


def _contains_stop(text: str, stop: Sequence[str], start: int) -> bool:
    return any(needle and needle in text[start:] for needle in stop)


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
