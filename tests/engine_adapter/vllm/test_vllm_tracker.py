"""The tracker's forcing and holding on bitmasks it is handed (no server: the grammar's side
is a crafted bitmask row, which is how a grammar that disagrees with the adapter is produced)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine_adapter import build_structural_tag, standard_evaluators
from engine_adapter._injector import TokenCodec
from engine_adapter.local import load_tokenizer
from engine_adapter.testing.vllm import GrammarOutput, tracker_rows


@pytest.fixture(scope="module")
def codec() -> TokenCodec:
    return TokenCodec.from_tokenizer(load_tokenizer())


@pytest.fixture(scope="module")
def tag() -> dict[str, Any]:
    grammar = build_structural_tag(standard_evaluators(["calc"]), "grammar-eval")
    assert grammar.structural_tag is not None
    return grammar.structural_tag


def _close_span(codec: TokenCodec, tracker: Any, scheduler: Any) -> None:
    for token in codec.encode_continuation(b"So <calc>6 * 7</calc>"):
        for request in scheduler.running:
            request.output_token_ids.append(token)
    tracker.before_schedule(scheduler)


def test_forced_row_is_narrowed_to_one_allowed_token(codec: TokenCodec, tag: Any) -> None:
    tracker, scheduler = tracker_rows(codec, 2, tag)
    _close_span(codec, tracker, scheduler)
    words = (codec.vocab_size + 31) // 32
    bitmask = np.full((2, words), -1, dtype=np.int32)
    tracker.narrow_bitmask(GrammarOutput(["r1", "r0"], bitmask))
    for row in bitmask:
        allowed = [w * 32 + b for w in range(words) for b in range(32) if (int(row[w]) >> b) & 1]
        assert len(allowed) == 1
        assert codec.token_bytes(allowed[0]) == b"<result>"[: len(codec.token_bytes(allowed[0]))]
    assert tracker.stats.forced_tokens == 2 and tracker.stats.faults == 0


def test_a_token_the_grammar_refuses_is_never_forced(codec: TokenCodec, tag: Any) -> None:
    tracker, scheduler = tracker_rows(codec, 1, tag)
    _close_span(codec, tracker, scheduler)
    words = (codec.vocab_size + 31) // 32
    bitmask = np.zeros((1, words), dtype=np.int32)  # the grammar allows nothing
    bitmask[0, 0] = 1  # but token 0
    tracker.narrow_bitmask(GrammarOutput(["r0"], bitmask))
    assert bitmask[0, 0] == 1 and not bitmask[0, 1:].any()  # left as the grammar had it
    state = tracker.requests["r0"]
    assert state.fault is not None and "refuses forced token" in state.fault
    assert tracker.stats.faults == 1


def test_a_pending_value_holds_the_request_out_of_the_next_step(
    codec: TokenCodec, tag: Any
) -> None:
    from engine_adapter._types import EvalResult

    tracker, scheduler = tracker_rows(codec, 1, tag)
    request = scheduler.running[0]
    scheduler.waiting.append(object())  # someone else could run: no idle wait
    state = tracker.requests["r0"]
    futures: list[Any] = []

    def submit(evaluator: str, content: str, deadline_ms: int) -> Any:
        import concurrent.futures

        futures.append(concurrent.futures.Future())
        return futures[-1]

    state.injector._evaluator.submit = submit  # type: ignore[union-attr]
    _close_span(codec, tracker, scheduler)
    words = (codec.vocab_size + 31) // 32
    # Force the value-independent "<result" prefix while the evaluation runs.
    while state.injector.forced_tokens():
        bitmask = np.full((1, words), -1, dtype=np.int32)
        tracker.narrow_bitmask(GrammarOutput(["r0"], bitmask))
        token = state.injector.forced_tokens()[0]
        request.output_token_ids.append(token)
        scheduler.current_step += 1
        tracker.before_schedule(scheduler)
    assert codec.decode(request.output_token_ids).endswith(b"</calc><result")
    assert request.next_decode_eligible_step == scheduler.current_step + 2  # held
    futures[0].set_result(EvalResult("42"))
    scheduler.current_step += 1
    tracker.before_schedule(scheduler)
    assert request.next_decode_eligible_step == 0  # released, as it was before the hold
    assert state.injector.forced_tokens()


def test_when_every_request_is_held_the_scheduler_sleeps_on_the_evaluation(
    codec: TokenCodec, tag: Any
) -> None:
    """Nobody else can run: one bounded wait on the pending future instead of a busy loop."""
    import concurrent.futures
    import time

    tracker, scheduler = tracker_rows(codec, 1, tag)
    state = tracker.requests["r0"]
    pending: concurrent.futures.Future[Any] = concurrent.futures.Future()
    state.injector._evaluator.submit = lambda *args: pending  # type: ignore[union-attr]
    _close_span(codec, tracker, scheduler)
    request = scheduler.running[0]
    while state.injector.forced_tokens():
        request.output_token_ids.append(state.injector.forced_tokens()[0])
        tracker.before_schedule(scheduler)
    started = time.monotonic()
    tracker.before_schedule(scheduler)
    waited = time.monotonic() - started
    assert tracker.stats.idle_waits >= 1
    assert 0.01 <= waited < 1.0  # one slice of IDLE_WAIT_S, not the span deadline
    assert request.next_decode_eligible_step > scheduler.current_step + 1
