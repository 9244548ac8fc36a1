"""One request's computed properties, as its engine drives them (a :class:`SpanState`).

The JSON twin of the :class:`~engine_adapter.evaluation.Injector`: the engine feeds it every
token that enters the sequence and asks it, before sampling, what to force. Where the injector
waits for a span to close, this state follows the document (:class:`JsonTracker`) and, when a
computed property's value is due, builds the evaluator's input from the values already
written, submits it, and forces the fixed text before the value (``, "answer": ``) at once and
the value itself once it is known::

    {"expression": "17 * 23 + 91", "answer": 482}
                                 ^ due: input "17 * 23 + 91", forced ', "answer": ' then '482}'

A failed, refused, late or misfitting value is forced as ``{"$error": "CODE"}``; the document
always stays valid for the lowered schema (docs/computed-fields.md). Records are
:class:`SpanRecord` with ``field`` set to the property's JSON pointer.

Thread-safety: like the injector, driven from one thread; evaluations complete elsewhere.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from engine_adapter.evaluation._json_tracker import Due, JsonTracker
from engine_adapter.evaluation._span_record import SpanRecord, deadline_at
from engine_adapter.evaluation._token_codec import TokenCodec
from engine_adapter.spans import (
    ERROR_CODE_REGEX,
    SCHEMA_MISMATCH,
    ComputedField,
    ComputedPlan,
    EvalResult,
    SpanEvaluator,
    ValueCheck,
    render_error,
)
from evald.contract import ErrorCode

__all__ = ["ComputedFieldsState"]

_ERROR_CODE = re.compile(ERROR_CODE_REGEX)


class _Step(NamedTuple):
    """Everything rollback restores; one per accepted token."""

    text_len: int
    tracker: tuple[Any, ...]
    due: Due | None
    """The value being forced (or waited for); None while the model writes."""
    queue: tuple[Due, ...]
    span_count: int


class ComputedFieldsState:
    """Follows one JSON document and forces its computed properties' values.

    Parameters:
        codec: the tokenizer's :class:`TokenCodec`.
        plan: the request's :class:`~engine_adapter.spans.ComputedPlan`.
        evaluator: where values are computed; ``None`` records the due values without
            evaluating or forcing (the model then writes them, as in ``grammar-no-eval``).
        deadline_ms: per value, from the moment it is due until it must be known.
        auto_flush: flush the evaluator after each submission (see :class:`Injector`).
    """

    def __init__(
        self,
        codec: TokenCodec | Any,
        plan: ComputedPlan,
        evaluator: SpanEvaluator | None,
        *,
        deadline_ms: int = 1000,
        auto_flush: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if deadline_ms <= 0:
            raise ValueError(f"deadline_ms must be positive, got {deadline_ms}")
        self._codec = codec if isinstance(codec, TokenCodec) else TokenCodec.shared(codec)
        self._plan = plan
        self._checks = [ValueCheck(f.schema) for f in plan.fields]
        self._evaluator = evaluator
        self._deadline_ms = deadline_ms
        self._deadline_s = deadline_ms / 1000.0
        self._auto_flush = auto_flush
        self._clock = clock
        self._table = self._codec.byte_table
        self._tracker = JsonTracker(plan)
        self._text = bytearray()
        self._spans: list[SpanRecord] = []
        self._history = [_Step(0, self._tracker.snapshot(), None, (), 0)]
        self._plan_cache: tuple[int, bool, tuple[int, ...]] | None = None

    # ----------------------------------------------------------------- what engines call

    def accept_token(self, token_id: int) -> None:
        """Records one token that entered the sequence (sampled or forced), in order."""
        step = self._history[-1]
        before = len(self._text)
        if 0 <= token_id < len(self._table):
            self._text += self._table[token_id]
        queue = step.queue
        if not self._tracker.done:
            dues = self._tracker.feed(self._text, before)
            if dues:
                queue = (*queue, *dues)
        step = step._replace(text_len=len(self._text), tracker=self._tracker.snapshot(),
                             queue=queue)  # fmt: skip
        self._history.append(self._advance(step))

    def accept_tokens(self, token_ids: Iterable[int]) -> None:
        for token_id in token_ids:
            self.accept_token(token_id)

    def forced_tokens(self) -> list[int]:
        """The tokens to force next; empty when the model may sample (or must wait)."""
        step = self._refresh()
        if step.due is None:
            return []
        record = self._spans[step.span_count - 1]
        full = record.result is not None
        cached = self._plan_cache
        if cached is not None and cached[0] == step.text_len and cached[1] == full:
            return list(cached[2])
        emitted = bytes(self._text[step.due.anchor :])
        target = self._target(step.due, record) if full else step.due.prefix.encode()
        try:
            tokens = tuple(self._codec.encode_continuation(target[len(emitted) :]))
        except ValueError:
            record.diverged = True
            self._history[-1] = self._advance(step._replace(due=None))
            return []
        self._plan_cache = (step.text_len, full, tokens)
        return list(tokens)

    def draft_limit(self, token_ids: Sequence[int]) -> int:
        """How many leading draft tokens may enter before a computed value becomes due.

        Pure: runs a copy of the tracker over the drafts' bytes."""
        step = self._history[-1]
        if step.due is not None or step.queue:
            return 0
        tracker = JsonTracker(self._plan)
        tracker.restore(step.tracker)
        text = bytearray(self._text)
        for index, token_id in enumerate(token_ids):
            before = len(text)
            text += self._table[token_id] if 0 <= token_id < len(self._table) else b""
            if not tracker.done and tracker.feed(text, before):
                return index
        return len(token_ids)

    @property
    def pending(self) -> bool:
        """A computed value is due and not yet all in the sequence: do not sample."""
        if self._history[-1].due is None:
            return False
        return self._refresh().due is not None

    @property
    def result_known(self) -> bool:
        step = self._history[-1]
        if step.due is None:
            return False
        step = self._refresh()
        return step.due is not None and self._spans[step.span_count - 1].result is not None

    @property
    def span_count(self) -> int:
        return self._history[-1].span_count

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until the due value is known, its deadline passes, or ``timeout_s``."""
        step = self._refresh()
        if step.due is None:
            return False
        record = self._spans[step.span_count - 1]
        record.block(self._evaluator, self._clock, timeout_s)
        return bool(self.forced_tokens())

    def give_up(self, message: str) -> None:
        """Ends the due value now with ``deadline_exceeded``; a later answer is ignored."""
        step = self._refresh()
        if step.due is None:
            return
        record = self._spans[step.span_count - 1]
        if record.result is None:
            self._set_result(step.due, record, EvalResult(None, ErrorCode.DEADLINE_EXCEEDED,
                                                          message))  # fmt: skip
            self._history[-1] = self._advance(step)

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last ``num_tokens`` accepted tokens, computed values included."""
        if num_tokens < 0 or num_tokens >= len(self._history):
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: {len(self._history) - 1} accepted"
            )
        if num_tokens == 0:
            return
        del self._history[len(self._history) - num_tokens :]
        step = self._history[-1]
        del self._text[step.text_len :]
        del self._spans[step.span_count :]
        self._tracker.restore(step.tracker)
        self._plan_cache = None
        if step.due is not None:
            self._spans[step.span_count - 1].diverged = False

    # ----------------------------------------------------------------- introspection

    @property
    def spans(self) -> list[SpanRecord]:
        """One record per computed value that became due, in order."""
        return list(self._spans[: self._history[-1].span_count])

    @property
    def text(self) -> str:
        return self._text.decode("utf-8", errors="replace")

    @property
    def num_tokens(self) -> int:
        return len(self._history) - 1

    @property
    def plan(self) -> ComputedPlan:
        return self._plan

    # ----------------------------------------------------------------- internals

    def _refresh(self) -> _Step:
        step = self._history[-1]
        if step.due is not None:
            record = self._spans[step.span_count - 1]
            if record.result is None and self._resolve(step.due, record):
                step = self._advance(step)
                self._history[-1] = step
        return step

    def _advance(self, step: _Step) -> _Step:
        """Opens queued values and closes the current one when the text holds all of it."""
        while True:
            if step.due is None:
                if not step.queue:
                    return step
                due, queue = step.queue[0], step.queue[1:]
                step = self._open(step._replace(due=due, queue=queue))
                continue
            record, current = self._spans[step.span_count - 1], step.due
            emitted = bytes(self._text[current.anchor :])
            if record.result is not None:
                target = self._target(current, record)
                if emitted.startswith(target):
                    step = step._replace(due=None)
                    continue
                if target.startswith(emitted):
                    return step
            else:
                prefix = current.prefix.encode()
                if prefix.startswith(emitted) or emitted.startswith(prefix):
                    return step
            record.diverged = True
            step = step._replace(due=None)

    def _open(self, step: _Step) -> _Step:
        due = step.due
        if due is None:  # pragma: no cover - _advance opens only a due value
            return step
        field = self._plan.fields[due.field]
        content = self._input(field)
        now = self._clock()
        record = SpanRecord(
            evaluator=field.evaluator,
            content=content,
            begin_offset=due.anchor,
            closed_at_token=len(self._history),
            submitted_at=now,
            deadline_at=deadline_at(self._evaluator, now, self._deadline_s),
            field=field.pointer,
        )
        del self._spans[step.span_count :]
        self._spans.append(record)
        step = step._replace(span_count=step.span_count + 1)
        self._plan_cache = None
        if self._evaluator is None:
            return step._replace(due=None)
        try:
            record.future = self._evaluator.submit(field.evaluator, content, self._deadline_ms)
            if self._auto_flush:
                self._evaluator.flush()
        except Exception as exc:  # a client must not raise; if it does, the value still ends
            self._set_result(
                due, record, EvalResult(None, ErrorCode.INTERNAL, f"submit failed: {exc}")
            )
        return step

    def _input(self, field: ComputedField) -> str:
        """The evaluator's input, read from the values already in the text."""
        values = [self._value(path) for _, path in field.sources]
        if field.form == "value":
            value = values[0]
            return value if isinstance(value, str) else _compact(value)
        if field.form == "array":
            return _compact(values)
        return _compact({name: value for (name, _), value in zip(field.sources, values,
                                                                  strict=True)})  # fmt: skip

    def _value(self, path: tuple[str, ...]) -> Any:
        recorded = self._tracker.value_span(path)
        if recorded is None:
            return None
        where, start, end = recorded
        try:
            value: Any = json.loads(bytes(self._text[start:end]).decode("utf-8"))
        except ValueError:
            return None
        for part in path[len(where) :]:
            if isinstance(value, dict):
                value = value.get(part)
            elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                value = value[int(part)]
            else:
                return None
        return value

    def _resolve(self, due: Due, record: SpanRecord) -> bool:
        """Takes the value if it is known, or the deadline error if it is due. Never blocks."""
        if record.result is not None:
            return True
        result = record.outcome(self._clock(), self._deadline_ms)
        if result is None:
            return False
        self._set_result(due, record, result)
        return True

    def _set_result(self, due: Due, record: SpanRecord, result: EvalResult) -> None:
        field = self._plan.fields[due.field]
        rendered = None
        if result.value is not None and result.error_code is None:
            rendered, why = self._checks[due.field].render(result.value)
            if rendered is not None and any(s in rendered for s in self._codec.special_texts):
                rendered, why = None, "contains the text of a special token"
            if rendered is None:
                result = EvalResult(None, SCHEMA_MISMATCH, f"{field.pointer}: {why}",
                                    result.fuel_used, result.eval_time_us)  # fmt: skip
        if rendered is None:
            code = result.error_code or ErrorCode.INTERNAL
            if not _ERROR_CODE.fullmatch(code):  # as the injector: the grammar allows no other
                code = ErrorCode.INTERNAL
            rendered = render_error(code)
            if result.value is not None or result.error_code != code:
                result = EvalResult(None, code, result.message, result.fuel_used,
                                    result.eval_time_us)  # fmt: skip
        record.result = result
        record.ready_at = self._clock()
        record.injected = rendered
        self._plan_cache = None

    def _target(self, due: Due, record: SpanRecord) -> bytes:
        field = self._plan.fields[due.field]
        return f"{due.prefix}{record.injected}{field.delimiter}".encode()


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
