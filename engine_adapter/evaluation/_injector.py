"""Per-request span detection and result forcing, independent of any engine.

An engine feeds the :class:`Injector` every token that enters the sequence (sampled or forced) and,
before sampling each step, asks it what to force::

    while not done:
        forced = injector.forced_tokens()
        if forced:                      # the local engine forwards them all at once;
            feed(forced)                # SGLang forces forced[0] per step
        elif injector.pending:          # a span closed and its value is not known yet
            injector.wait()             # bounded by the span's deadline
            continue
        else:
            feed([sample(masked_logits)])
    # feed(ids): forward ids, then matcher.accept_token(i) and injector.accept_token(i) for each

Spans are detected on the **decoded bytes**, never by token ids: SmolLM2's BPE merges ``><``,
``)<``, ``></`` and ``Ġ<``, so a tag can begin or end in the middle of a token. For the same reason
only the *remainder* of the result text after what the sequence already holds is forced (the
model may have sampled ``><``, the ``<`` of ``<result``, as the token that closed the span).

While the evaluation runs, the value-independent prefix shared by success and error (``<result``)
can be forced already: that is the slack the engine can use to hide the evaluation's latency.
A deadline always ends in ``<result_error>deadline_exceeded</result_error>``: generation never
hangs on a slow or absent evaluator.

Thread-safety: one injector belongs to one request and must be driven from one thread (the
evaluations complete on other threads; the injector only reads their futures).
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from engine_adapter.evaluation._span_record import SpanRecord, deadline_at
from engine_adapter.evaluation._token_codec import TokenCodec
from engine_adapter.spans import (
    ERROR_CODE_REGEX,
    EvalResult,
    SpanBinding,
    SpanEvaluator,
    check_bindings,
    common_prefix,
)
from evald.contract import ErrorCode

__all__ = ["Injector"]

_ERROR_CODE = re.compile(ERROR_CODE_REGEX)


def _unforceable(value: str, result_end: str, special_texts: Sequence[str]) -> str | None:
    """Why ``value`` must not be forced as a result, or None."""
    if "<" in value or result_end in value:
        return "contains '<', which the ABI forbids in a value"
    for text in special_texts:
        if text in value:
            return f"contains the special token {text!r}"
    return None


class _Phase(enum.Enum):
    OUTSIDE = "outside"
    INSIDE = "inside"
    RESULT = "result"


class _State(NamedTuple):
    """Everything rollback must restore; one per accepted token (a tuple: cheap, immutable)."""

    text_len: int = 0
    phase: _Phase = _Phase.OUTSIDE
    # OUTSIDE: where the search for an opener resumes; INSIDE: start of the content;
    # RESULT: start of the result region (just after the closing string).
    mark: int = 0
    binding: int = -1
    span_count: int = 0
    plan: tuple[int, ...] = ()
    plan_at: int = -1
    """``text_len`` the plan was computed for; any other value means the plan is stale."""
    plan_full: bool = False
    """The plan covers the whole result text (else only the shared prefix ``<result``)."""


# The per-token fast path builds states without the named tuple's Python-level ``__new__``.
_new_state = tuple.__new__
_OUTSIDE = _Phase.OUTSIDE


class Injector:
    """Detects closed spans, submits them, and tells the engine which tokens to force.

    Parameters:
        codec: the tokenizer's :class:`TokenCodec` (or a transformers tokenizer, for which the
            process-wide shared codec is used).
        bindings: the span kinds (``SpanGrammar.bindings``).
        evaluator: where spans are evaluated; ``None`` records spans without evaluating or
            forcing anything (``grammar-no-eval`` and ``no-grammar``, for the study's records).
        deadline_ms: per span, from the moment it closes until its value must be known. At the
            deadline the result becomes ``deadline_exceeded`` whatever the evaluator does.
        auto_flush: call ``evaluator.flush()`` right after each submission. Engines that batch
            many requests per step pass ``False`` and flush once per step themselves;
            :meth:`wait` flushes in any case before it blocks.

    Raises:
        ValueError: bindings the text scanner cannot tell apart (see ``check_bindings``).
    """

    def __init__(
        self,
        codec: TokenCodec | Any,
        bindings: Sequence[SpanBinding],
        evaluator: SpanEvaluator | None,
        *,
        deadline_ms: int = 1000,
        auto_flush: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if deadline_ms <= 0:
            raise ValueError(f"deadline_ms must be positive, got {deadline_ms}")
        check_bindings(list(bindings))
        self._codec = codec if isinstance(codec, TokenCodec) else TokenCodec.shared(codec)
        self._bindings = tuple(bindings)
        self._evaluator = evaluator
        self._deadline_s = deadline_ms / 1000.0
        self._deadline_ms = deadline_ms
        self._auto_flush = auto_flush
        self._clock = clock
        self._begins = [b.begin.encode() for b in self._bindings]
        self._begin_index = {begin: i for i, begin in enumerate(self._begins)}
        # One C-level search for every opener at once; longest first so that the leftmost
        # match is also the longest (openers cannot be prefixes of each other anyway).
        self._begin_pattern = re.compile(
            b"|".join(re.escape(b) for b in sorted(self._begins, key=len, reverse=True))
        )
        self._ends = [b.end.encode() for b in self._bindings]
        self._max_begin = max((len(b) for b in self._begins), default=1)
        self._max_tag = max([self._max_begin, *(len(e) for e in self._ends)])
        self._prefixes = [
            common_prefix(b.result_begin, b.error_begin).encode() for b in self._bindings
        ]
        self._value_checks: list[re.Pattern[str] | None] = []
        for b in self._bindings:
            try:
                self._value_checks.append(re.compile(b.result_regex) if b.result_regex else None)
            except re.error:
                self._value_checks.append(None)  # XGrammar-only syntax: the grammar still checks
        self._text = bytearray()
        self._token_bytes = self._codec.byte_table
        self._vocab_n = len(self._token_bytes)
        self._spans: list[SpanRecord] = []
        self._history: list[_State] = [_State()]

    # ----------------------------------------------------------------- what engines call

    def accept_token(self, token_id: int) -> None:
        """Records one token that entered the sequence (sampled or forced), in order.

        Runs for every token of every evaluated sequence on the engine's scheduler thread, so
        free text (no opener in sight) takes a short path: one C-level search over the last
        few bytes and one history entry, no other Python work.
        """
        history = self._history
        state = history[-1]
        text = self._text
        before = len(text)
        text += self._token_bytes[token_id] if 0 <= token_id < self._vocab_n else b""  # in place
        after = len(text)
        if state.phase is _OUTSIDE:  # the common case: free text, no opener in sight
            start = before - self._max_begin + 1
            if start < state.mark:
                start = state.mark
            if self._begin_pattern.search(text, start) is None:
                mark = after - self._max_begin + 1
                if mark < state.mark:
                    mark = state.mark
                history.append(
                    _new_state(_State, (after, _OUTSIDE, mark, -1, state.span_count, (), -1, False))
                )
                return
        if state.plan and state.plan_at == before and state.plan[0] == token_id:
            rest = state.plan[1:]
        else:
            rest = ()
        state = state._replace(text_len=after, plan=rest, plan_at=after if rest else -1)
        history.append(self._advance(state, before))

    def accept_tokens(self, token_ids: Iterable[int]) -> None:
        for token_id in token_ids:
            self.accept_token(token_id)

    def forced_tokens(self) -> list[int]:
        """The tokens to force next, in order; empty when the model may sample (or must wait).

        Does not block and does not consume: feed the tokens back through :meth:`accept_token`
        as they enter the sequence. An engine may force any prefix of the list (SGLang forces
        one per step); the rest stays queued.
        """
        state = self._refresh()
        if state.phase is not _Phase.RESULT:
            return []
        record = self._spans[state.span_count - 1]
        if state.plan_at == state.text_len and (state.plan_full or record.result is None):
            return list(state.plan)
        emitted = bytes(self._text[state.mark :])
        if record.result is not None:
            target = self._render(state.binding, record.result)
            remaining, full = target[len(emitted) :], True
        else:
            prefix = self._prefixes[state.binding]
            remaining, full = prefix[len(emitted) :], False
        try:
            plan = tuple(self._codec.encode_continuation(remaining))
        except ValueError:
            record.diverged = True  # the vocabulary cannot spell it: give the sequence back
            self._history[-1] = self._leave(state, state.mark)
            return []
        self._history[-1] = state._replace(plan=plan, plan_at=state.text_len, plan_full=full)
        return list(plan)

    def draft_limit(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` may enter the sequence without closing a span.

        For speculative decoding: a proposer's draft tokens are verified in one forward, and a
        span that closed inside them would have its result region sampled by the model (the
        verify step sees no forced row there). Drafts are cut before the token that closes a
        span, so a span can only close on the step's last, sampled token, which the engine
        sees before the next step. Pure: nothing is submitted, recorded or remembered. While a
        span waits for its region the answer is 0 (the region is forced, never drafted).
        """
        state = self._history[-1]
        if state.phase is _Phase.RESULT:
            return 0
        phase, binding, mark = state.phase, state.binding, state.mark
        text = self._text
        table, vocab_n = self._token_bytes, self._vocab_n
        if phase is _Phase.OUTSIDE:  # the common case: one search over all the drafts' bytes
            start = max(mark, len(text) - self._max_begin + 1)
            drafted = b"".join(table[t] for t in token_ids if 0 <= t < vocab_n)
            if self._begin_pattern.search(bytes(text[start:]) + drafted) is None:
                return len(token_ids)
        # Only the last few bytes can still be part of an opener or a closing tag.
        base = max(0, len(text) - self._max_tag + 1)
        window = bytearray(text[base:])
        for index, token_id in enumerate(token_ids):
            before = base + len(window)
            window += table[token_id] if 0 <= token_id < vocab_n else b""
            while True:
                if phase is _Phase.OUTSIDE:
                    start = max(mark, before - self._max_begin + 1) - base
                    match = self._begin_pattern.search(window, start)
                    if match is None:
                        break
                    binding = self._begin_index[match.group()]
                    phase = _Phase.INSIDE
                    mark = base + match.end()
                else:
                    end = self._ends[binding]
                    if window.find(end, max(mark, before - len(end) + 1) - base) >= 0:
                        return index
                    break
        return len(token_ids)

    @property
    def pending(self) -> bool:
        """A span closed and its result region is not complete: the engine must not sample.

        Then either :meth:`forced_tokens` has tokens, or the value is not known yet and the
        engine should :meth:`wait`.
        """
        if self._history[-1].phase is not _Phase.RESULT:  # no span waits: nothing to refresh
            return False
        return self._refresh().phase is _Phase.RESULT

    @property
    def result_known(self) -> bool:
        """A span waits for its region and its result is decided (the value came back, or the
        deadline passed): :meth:`forced_tokens` then spans the whole rest of the region, so an
        engine can put all of it into the sequence at once (SGLang's jump forward)."""
        if self._history[-1].phase is not _Phase.RESULT:
            return False
        state = self._refresh()
        return state.phase is _Phase.RESULT and self._spans[state.span_count - 1].result is not None

    @property
    def span_count(self) -> int:
        """How many spans closed in the current sequence (``len(spans)`` without the copy)."""
        return self._history[-1].span_count

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until the pending span's value is known, the deadline passes, or ``timeout_s``.

        Flushes the evaluator first (a submission must be on its way before anyone waits for
        it). After the deadline the result is ``deadline_exceeded``, so a loop of ``wait`` and
        :meth:`forced_tokens` always terminates.

        Returns:
            Whether there is something to force now.
        """
        state = self._refresh()
        if state.phase is not _Phase.RESULT:
            return False
        record = self._spans[state.span_count - 1]
        record.block(self._evaluator, self._clock, timeout_s)
        return bool(self.forced_tokens())

    def give_up(self, message: str) -> None:
        """Ends the pending span now with ``deadline_exceeded`` (``message`` says why): for an
        engine that cannot wait any longer for the value without holding other sequences
        (``engine_adapter.serving._step_wait``). An answer that comes later is ignored. No-op
        when no span waits for its value."""
        state = self._refresh()
        if state.phase is not _Phase.RESULT:
            return
        record = self._spans[state.span_count - 1]
        if record.result is not None:
            return
        self._set_result(
            state.binding, record, EvalResult(None, ErrorCode.DEADLINE_EXCEEDED, message)
        )
        self._history[-1] = self._advance(state, state.text_len)

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last ``num_tokens`` accepted tokens: text, span detection and queue.

        Spans that closed within the forgotten tokens are dropped from :attr:`spans` (their
        evaluations, if still running, are ignored); a span closed again is submitted again.

        Raises:
            ValueError: more tokens than were accepted.
        """
        if num_tokens < 0 or num_tokens >= len(self._history):
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: {len(self._history) - 1} accepted"
            )
        if num_tokens == 0:
            return
        del self._history[len(self._history) - num_tokens :]
        state = self._history[-1]
        del self._text[state.text_len :]
        del self._spans[state.span_count :]
        if state.phase is _Phase.RESULT:
            self._spans[state.span_count - 1].diverged = False  # decided again from here

    # ----------------------------------------------------------------- introspection

    @property
    def spans(self) -> list[SpanRecord]:
        """Every span that closed in the current sequence, in order."""
        return list(self._spans[: self._history[-1].span_count])

    @property
    def num_tokens(self) -> int:
        return len(self._history) - 1

    @property
    def text(self) -> str:
        """The decoded text of all accepted tokens (invalid UTF-8 replaced)."""
        return self._text.decode("utf-8", errors="replace")

    @property
    def in_span(self) -> bool:
        """Inside a span's content (opened, not yet closed)."""
        return self._history[-1].phase is _Phase.INSIDE

    @property
    def bindings(self) -> tuple[SpanBinding, ...]:
        return self._bindings

    # ----------------------------------------------------------------- internals

    def _refresh(self) -> _State:
        """Resolves the current span's result if it became known and moves on if that decides
        anything (the sequence may already hold more than the shared prefix)."""
        state = self._history[-1]
        if state.phase is _Phase.RESULT:
            record = self._spans[state.span_count - 1]
            if record.result is None and self._resolve(state.binding, record):
                state = self._advance(state, state.text_len)
                self._history[-1] = state
        return state

    def _advance(self, state: _State, before: int) -> _State:
        """Runs the scanner over the bytes added since ``before`` (possibly several phases:
        ``><`` both closes a span and starts its result region)."""
        text = self._text
        while True:
            if state.phase is _Phase.OUTSIDE:
                start = max(state.mark, before - self._max_begin + 1)
                found = self._find_begin(start)
                if found is None:
                    mark = max(state.mark, len(text) - self._max_begin + 1)
                    return state._replace(mark=mark)
                index, at = found
                state = state._replace(
                    phase=_Phase.INSIDE, binding=index, mark=at + len(self._begins[index])
                )
            elif state.phase is _Phase.INSIDE:
                end = self._ends[state.binding]
                at = text.find(end, max(state.mark, before - len(end) + 1))
                if at < 0:
                    return state
                state = self._close(state, at)
            else:
                record = self._spans[state.span_count - 1]
                emitted = bytes(text[state.mark :])
                if record.result is not None:
                    target = self._render(state.binding, record.result)
                    if emitted.startswith(target):
                        state = self._leave(state, state.mark + len(target))
                        continue
                    if target.startswith(emitted):
                        return state
                else:
                    prefix = self._prefixes[state.binding]
                    if prefix.startswith(emitted) or emitted.startswith(prefix):
                        return state  # consistent so far; decided once the value is known
                record.diverged = True
                state = self._leave(state, state.mark)

    def _find_begin(self, start: int) -> tuple[int, int] | None:
        match = self._begin_pattern.search(self._text, start)
        if match is None:
            return None
        return self._begin_index[match.group()], match.start()

    def _close(self, state: _State, end_at: int) -> _State:
        binding = self._bindings[state.binding]
        content_bytes = bytes(self._text[state.mark : end_at])
        now = self._clock()
        record = SpanRecord(
            evaluator=binding.evaluator,
            content=content_bytes.decode("utf-8", errors="replace"),
            begin_offset=state.mark - len(self._begins[state.binding]),
            closed_at_token=len(self._history),
            submitted_at=now,
            deadline_at=deadline_at(self._evaluator, now, self._deadline_s),
        )
        del self._spans[state.span_count :]
        self._spans.append(record)
        result_at = end_at + len(self._ends[state.binding])
        state = state._replace(
            phase=_Phase.RESULT,
            mark=result_at,
            span_count=state.span_count + 1,
            plan=(),
            plan_at=-1,
            plan_full=False,
        )
        if self._evaluator is None:
            return self._leave(state, result_at)
        try:
            record.future = self._evaluator.submit(
                binding.evaluator, record.content, self._deadline_ms
            )
            if self._auto_flush:
                self._evaluator.flush()
        except Exception as exc:  # a client must not raise; if it does, the span still ends
            self._set_result(
                state.binding, record, EvalResult(None, ErrorCode.INTERNAL, f"submit failed: {exc}")
            )
        return state

    def _leave(self, state: _State, mark: int) -> _State:
        return state._replace(
            phase=_Phase.OUTSIDE, mark=mark, binding=-1, plan=(), plan_at=-1, plan_full=False
        )

    def _resolve(self, binding_index: int, record: SpanRecord) -> bool:
        """Takes the value if it is known, or the deadline error if it is due. Never blocks."""
        if record.result is not None:
            return True
        result = record.outcome(self._clock(), self._deadline_ms)
        if result is None:
            return False
        self._set_result(binding_index, record, result)
        return True

    def _set_result(self, binding_index: int, record: SpanRecord, result: EvalResult) -> None:
        record.result = self._sanitize(binding_index, result)
        record.ready_at = self._clock()
        record.injected = self._render(binding_index, record.result).decode("utf-8", "replace")

    def _sanitize(self, binding_index: int, result: EvalResult) -> EvalResult:
        """Makes sure the grammar will accept the rendered result (its tokens are forced), and
        that forcing it cannot spell anything but a value.

        The daemon refuses evaluators whose result language holds ``<``; this is the defence in
        depth for whatever answers the span (another daemon, an in-process evaluator): a value
        with ``<`` (the ABI forbids it: it could close the result or open a tag) or with the
        text of one of the tokenizer's special tokens, or outside the evaluator's result regex
        (when Python's ``re`` reads it), becomes ``guest_fault`` instead.
        """
        binding = self._bindings[binding_index]
        if result.value is not None and result.error_code is None:
            value = result.value
            reason = _unforceable(value, binding.result_end, self._codec.special_texts)
            check = self._value_checks[binding_index]
            if reason is None and check is not None and check.fullmatch(value) is None:
                reason = "does not match its result_regex"
            if reason is None:
                return result
            return EvalResult(
                None,
                ErrorCode.GUEST_FAULT,
                f"the evaluator's value {value[:40]!r} {reason}",
                result.fuel_used,
                result.eval_time_us,
            )
        code = result.error_code or ErrorCode.INTERNAL
        if not _ERROR_CODE.fullmatch(code):
            code = ErrorCode.INTERNAL
        if code == result.error_code and result.value is None:
            return result
        return EvalResult(None, code, result.message, result.fuel_used, result.eval_time_us)

    def _render(self, binding_index: int, result: EvalResult) -> bytes:
        b = self._bindings[binding_index]
        if result.value is not None and result.error_code is None:
            return (b.result_begin + result.value + b.result_end).encode()
        return (b.error_begin + (result.error_code or ErrorCode.INTERNAL) + b.error_end).encode()
