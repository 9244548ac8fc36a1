"""The step-wait budget (``engine_adapter.serving._step_wait``): a row that must have a token
while its value is pending and nothing of the region can be forced waits at most what is left of its
step's small budget; past it the span ends in band, so no other row of the batch waits.

Spans here use result and error openers with no shared first character (``[`` / ``{``): then
nothing can be forced before the value is known. A byte-level vocabulary (no model needed).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator

import pytest

from engine_adapter import EvalResult, Injector, SpanBinding, TokenCodec
from engine_adapter.serving._step_wait import STEP_WAIT_BUDGET_S, StepWaits

_CODEC = TokenCodec([bytes([i]) for i in range(256)])
#: Result and error openers that share nothing: no token can be forced before the value.
APART = SpanBinding("calc", "<calc>", "</calc>", "[", "]", "{", "}")
SHARED = SpanBinding("calc", "<calc>", "</calc>")
#: Far beyond any budget here: a span that ends did not wait for its deadline.
DEADLINE_MS = 60_000


class Unanswered:
    """Stands in for a stopped evaluator (a fault no evaluator produces on demand): futures
    that stay pending until the test answers them."""

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future[EvalResult]] = []

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        future: concurrent.futures.Future[EvalResult] = concurrent.futures.Future()
        self.futures.append(future)
        return future

    def flush(self) -> None:
        pass


@pytest.fixture
def evaluator() -> Iterator[Unanswered]:
    evaluator = Unanswered()
    yield evaluator
    for future in evaluator.futures:
        if not future.done():
            future.set_result(EvalResult("0"))


def closed(evaluator: Unanswered, binding: SpanBinding = APART, **options: int) -> Injector:
    injector = Injector(
        _CODEC, [binding], evaluator, deadline_ms=options.get("deadline_ms", DEADLINE_MS)
    )
    injector.accept_tokens(list(b"So <calc>6 * 7</calc>"))
    assert injector.pending
    return injector


class SteppedClock:
    """The budget's clock, moved by the test: what the code decides, not two clocks."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_value_back_within_the_budget_is_forced(evaluator: Unanswered) -> None:
    injector = closed(evaluator)
    assert injector.forced_tokens() == []  # nothing of "[42]" / "{…}" before the value
    answer = threading.Timer(0.05, evaluator.futures[0].set_result, [EvalResult("42")])
    answer.start()
    waits = StepWaits(budget_s=DEADLINE_MS / 1000 / 2)  # the wait ends when the value lands
    assert waits.settle(injector)
    answer.join()
    assert _CODEC.decode(injector.forced_tokens()) == b"[42]"
    assert (waits.waits, waits.gave_up) == (1, 0)
    assert injector.spans[0].value == "42" and injector.spans[0].waited_s > 0


def test_a_value_already_back_is_forced_without_waiting(evaluator: Unanswered) -> None:
    injector = closed(evaluator)
    evaluator.futures[0].set_result(EvalResult("42"))
    waits = StepWaits()
    assert waits.settle(injector)
    assert _CODEC.decode(injector.forced_tokens()) == b"[42]"
    assert (waits.waits, waits.gave_up) == (0, 0)


def test_a_late_value_ends_the_span_in_band_at_the_budget(evaluator: Unanswered) -> None:
    injector = closed(evaluator)
    waits = StepWaits(budget_s=0.02)
    assert waits.settle(injector)
    assert _CODEC.decode(injector.forced_tokens()) == b"{deadline_exceeded}"
    (span,) = injector.spans
    assert span.error_code == "deadline_exceeded"
    assert span.result is not None and "step budget of 20 ms" in span.result.message
    assert "shared first character" in span.result.message  # what to change
    assert 0 < span.waited_s < DEADLINE_MS / 1000 / 2  # it waited, not until its deadline
    assert (waits.waits, waits.gave_up) == (1, 1)
    # The answer that comes afterwards changes nothing: the region is decided.
    evaluator.futures[0].set_result(EvalResult("42"))
    assert _CODEC.decode(injector.forced_tokens()) == b"{deadline_exceeded}"
    injector.accept_tokens(injector.forced_tokens())
    assert not injector.pending
    assert injector.text == "So <calc>6 * 7</calc>{deadline_exceeded}"


def test_the_rows_of_one_step_share_one_budget(evaluator: Unanswered) -> None:
    clock = SteppedClock()
    waits = StepWaits(budget_s=0.01, clock=clock)
    first, second, third = (closed(evaluator) for _ in range(3))
    waits.new_step()
    assert waits.settle(first)
    clock.now += 0.01  # the first row used the step's whole budget
    assert waits.settle(second)
    assert first.spans[0].waited_s > 0
    assert second.spans[0].waited_s == 0.0  # nothing left: in band at once
    assert second.spans[0].error_code == "deadline_exceeded"
    waits.new_step()  # the next step has a budget of its own
    answer = threading.Timer(0.05, evaluator.futures[2].set_result, [EvalResult("42")])
    answer.start()
    clock.now += 1.0
    waits.budget_s = DEADLINE_MS / 1000 / 2
    assert waits.settle(third)
    answer.join()
    assert third.spans[0].value == "42"
    assert (waits.waits, waits.gave_up) == (3, 2)


def test_the_budget_opens_at_the_steps_first_wait(evaluator: Unanswered) -> None:
    clock = SteppedClock()
    waits = StepWaits(budget_s=0.01, clock=clock)
    waits.new_step()
    clock.now += 5.0  # the step's forward ran before any row needed a value
    injector = closed(evaluator)
    evaluator.futures[0].set_result(EvalResult("7"))
    assert waits.settle(injector)
    assert injector.spans[0].value == "7"


def test_a_row_with_something_to_force_never_waits(evaluator: Unanswered) -> None:
    injector = closed(evaluator, SHARED)
    waits = StepWaits()
    assert waits.settle(injector)
    assert _CODEC.decode(injector.forced_tokens()) == b"<result"
    assert (waits.waits, waits.gave_up) == (0, 0)
    assert injector.spans[0].result is None  # still evaluating


def test_a_span_past_its_deadline_ends_with_its_own_error(evaluator: Unanswered) -> None:
    injector = closed(evaluator, deadline_ms=1)
    waits = StepWaits(budget_s=0.05)
    while not injector.result_known:  # 1 ms: the deadline passes while the row waits
        waits.settle(injector)
    assert waits.gave_up <= 1
    (span,) = injector.spans
    assert span.error_code == "deadline_exceeded"


def test_nothing_pending_is_left_alone(evaluator: Unanswered) -> None:
    injector = Injector(_CODEC, [APART], evaluator, deadline_ms=DEADLINE_MS)
    injector.accept_tokens(list(b"plain text"))
    waits = StepWaits()
    assert not waits.settle(injector)
    injector.give_up("nothing to give up")
    assert injector.spans == [] and (waits.waits, waits.gave_up) == (0, 0)


def test_the_budget_is_small_and_never_negative() -> None:
    assert 0 < STEP_WAIT_BUDGET_S <= 0.01
    with pytest.raises(ValueError, match="negative"):
        StepWaits(budget_s=-1)
