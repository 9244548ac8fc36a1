"""The tracker's forcing and holding on bitmasks it is handed (no server: the grammar's side
is a crafted bitmask row, which is how a grammar that disagrees with the adapter is produced)."""

from __future__ import annotations

import concurrent.futures
import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from engine_adapter import build_structural_tag, standard_evaluators
from engine_adapter.evaluation._token_codec import TokenCodec
from engine_adapter.local import load_tokenizer
from engine_adapter.testing.vllm import FakeRequest, FakeScheduler, GrammarOutput, tracker_rows


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
    from engine_adapter.spans._types import EvalResult

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


# ------------------------------------------------------------------ with speculative decoding


class _Answers:
    """Answers each span with ``value`` at once, or holds it until ``release``."""

    def __init__(self, value: str = "42", *, held: bool = False) -> None:
        self.value = value
        self.futures: list[concurrent.futures.Future[Any]] = []
        self.held = held

    def submit(self, evaluator: str, content: str, deadline_ms: int) -> Any:
        from engine_adapter.spans._types import EvalResult

        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if not self.held:
            future.set_result(EvalResult(self.value))
        self.futures.append(future)
        return future

    def release(self) -> None:
        from engine_adapter.spans._types import EvalResult

        for future in self.futures:
            if not future.done():
                future.set_result(EvalResult(self.value))

    def flush(self) -> None:
        return None


def _drafting(
    codec: TokenCodec, tag: Any, rows: int, max_drafts: int, answers: _Answers
) -> tuple[Any, FakeScheduler]:
    from engine_adapter.serving._server_config import AdapterConfig
    from engine_adapter.vllm._tracker import SpanTracker

    tracker = SpanTracker(
        AdapterConfig(target="unix:/test.sock"),
        codec,
        max_drafts=max_drafts,
        runtime_factory=lambda cfg: answers,  # type: ignore[arg-type,return-value]
    )
    params = SimpleNamespace(
        structured_outputs=SimpleNamespace(structural_tag=json.dumps(tag)), extra_args=None
    )
    requests = {f"r{i}": FakeRequest(f"r{i}", params) for i in range(rows)}
    for request in requests.values():
        assert tracker.add(request) is not None
    scheduler = FakeScheduler(requests, list(requests.values()))
    scheduler.waiting.append(object())  # someone else could run: no idle wait
    return tracker, scheduler


def _allowed(row: Any, words: int) -> list[int]:
    return [w * 32 + b for w in range(words) for b in range(32) if (int(row[w]) >> b) & 1]


def test_a_known_value_goes_in_as_drafts_and_every_draft_row_is_narrowed(
    codec: TokenCodec, tag: Any
) -> None:
    tracker, scheduler = _drafting(codec, tag, 2, 16, _Answers("42"))
    r0, r1 = scheduler.running
    r0.output_token_ids.extend(codec.encode_continuation(b"So <calc>6 * 7</calc>"))
    r1.output_token_ids.extend(codec.encode_continuation(b"So "))
    r1.spec_token_ids = codec.encode_continuation(b"we have")  # a proposer's, left alone
    tracker.before_schedule(scheduler)
    assert r0.next_decode_eligible_step == 0  # the value was known: not held
    assert codec.decode(r0.output_token_ids + r0.spec_token_ids).endswith(
        b"</calc><result>42</result>"
    )
    drafts = list(r0.spec_token_ids)
    assert r1.spec_token_ids == codec.encode_continuation(b"we have")
    # vLLM's rows: r1's two drafts and its sampled token first, then r0's drafts and one more.
    spec = {"r1": list(r1.spec_token_ids), "r0": drafts}
    words = (codec.vocab_size + 31) // 32
    rows = len(spec["r1"]) + 1 + len(drafts) + 1
    bitmask = np.full((rows, words), -1, dtype=np.int32)
    tracker.narrow_bitmask(
        GrammarOutput(["r1", "r0"], bitmask), SimpleNamespace(scheduled_spec_decode_tokens=spec)
    )
    first = len(spec["r1"]) + 1
    assert (bitmask[:first] == -1).all()  # r1's rows are untouched
    for offset, token in enumerate(drafts):
        assert _allowed(bitmask[first + offset], words) == [token]
    assert (bitmask[-1] == -1).all()  # the token after the region is the model's
    assert tracker.stats.forced_tokens == len(drafts) and tracker.stats.draft_steps == 1
    assert tracker.stats.faults == 0


def test_a_region_longer_than_the_drafts_also_forces_the_token_after_them(
    codec: TokenCodec, tag: Any
) -> None:
    tracker, scheduler = _drafting(codec, tag, 1, 2, _Answers("42"))
    request = scheduler.running[0]
    request.output_token_ids.extend(codec.encode_continuation(b"So <calc>6 * 7</calc>"))
    tracker.before_schedule(scheduler)
    region = tracker.requests["r0"].injector.forced_tokens()
    assert len(region) > 3 and request.spec_token_ids == region[:2]
    words = (codec.vocab_size + 31) // 32
    bitmask = np.full((3, words), -1, dtype=np.int32)
    spec = {"r0": region[:2]}
    tracker.narrow_bitmask(
        GrammarOutput(["r0"], bitmask), SimpleNamespace(scheduled_spec_decode_tokens=spec)
    )
    assert [_allowed(row, words) for row in bitmask] == [[t] for t in region[:3]]
    # The verify step keeps both drafts and samples the third; the rest goes in next step.
    request.output_token_ids.extend(region[:3])
    tracker.before_schedule(scheduler)
    assert request.spec_token_ids == region[3:5]


def test_with_drafts_a_pending_value_holds_the_request_and_drops_proposer_drafts(
    codec: TokenCodec, tag: Any
) -> None:
    answers = _Answers("42", held=True)
    tracker, scheduler = _drafting(codec, tag, 1, 16, answers)
    request = scheduler.running[0]
    request.output_token_ids.extend(codec.encode_continuation(b"So <calc>6 * 7</calc>"))
    request.spec_token_ids = codec.encode_continuation(b"<result>99</result>")  # a proposer's
    tracker.before_schedule(scheduler)
    # Held (nothing forced before the value is known: the region takes one forward later),
    # and no proposer draft may enter the region.
    assert request.next_decode_eligible_step == scheduler.current_step + 2
    assert request.spec_token_ids == []
    assert tracker.stats.forced_tokens == 0
    answers.release()
    scheduler.current_step += 1
    tracker.before_schedule(scheduler)
    assert request.next_decode_eligible_step == 0
    assert codec.decode(request.output_token_ids + request.spec_token_ids).endswith(
        b"</calc><result>42</result>"
    )


def test_proposer_drafts_are_cut_before_the_token_that_closes_a_span(
    codec: TokenCodec, tag: Any
) -> None:
    tracker, scheduler = _drafting(codec, tag, 1, 16, _Answers("42"))
    request = scheduler.running[0]
    request.output_token_ids.extend(codec.encode_continuation(b"So <calc>6 * 7"))
    drafts = codec.encode_continuation(b"</calc><result>99</result>.")
    request.spec_token_ids = list(drafts)
    tracker.before_schedule(scheduler)
    kept = request.spec_token_ids
    assert kept == drafts[: len(kept)] and len(kept) < len(drafts)
    assert b"</calc>" not in codec.decode(request.output_token_ids + kept)
    assert b"</calc>" in codec.decode(request.output_token_ids + drafts[: len(kept) + 1])
    assert tracker.stats.cut_drafts == 1
    # Nothing closes inside these: left as proposed.
    request.spec_token_ids = codec.encode_continuation(b" + 1")
    tracker.before_schedule(scheduler)
    assert request.spec_token_ids == codec.encode_continuation(b" + 1")
    assert tracker.stats.cut_drafts == 1


def test_scheduled_drafts_that_are_not_the_forced_tokens_stop_forcing(
    codec: TokenCodec, tag: Any
) -> None:
    tracker, scheduler = _drafting(codec, tag, 1, 16, _Answers("42"))
    request = scheduler.running[0]
    request.output_token_ids.extend(codec.encode_continuation(b"So <calc>6 * 7</calc>"))
    tracker.before_schedule(scheduler)
    words = (codec.vocab_size + 31) // 32
    wrong = codec.encode_continuation(b"<result>99</result>")
    bitmask = np.full((len(wrong) + 1, words), -1, dtype=np.int32)
    tracker.narrow_bitmask(
        GrammarOutput(["r0"], bitmask),
        SimpleNamespace(scheduled_spec_decode_tokens={"r0": wrong}),
    )
    assert (bitmask == -1).all()
    fault = tracker.requests["r0"].fault
    assert fault is not None and "are not the forced" in fault


def test_forced_drafts_the_grammar_refuses_are_never_scheduled(codec: TokenCodec, tag: Any) -> None:
    """The drafts are checked as vLLM checks a proposer's (``validate_tokens``), here by a
    real XGrammar matcher of a grammar whose result region cannot hold the value."""
    import xgrammar as xgr

    from engine_adapter.local import load_tokenizer

    tracker, scheduler = _drafting(codec, tag, 1, 16, _Answers("42"))
    request = scheduler.running[0]
    prefix = codec.encode_continuation(b"So <calc>6 * 7</calc>")
    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(), vocab_size=codec.vocab_size)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(
        'root ::= "So <calc>6 * 7</calc><result>4" [5-9] "</result>"'
    )

    class _Manager:
        def validate_tokens(self, req: Any, tokens: list[int]) -> list[int]:
            matcher = xgr.GrammarMatcher(compiled)
            assert all(matcher.accept_token(t) for t in req.output_token_ids)
            valid = []
            for token in tokens:
                if not matcher.accept_token(token):
                    break
                valid.append(token)
            return valid

    scheduler.structured_output_manager = _Manager()
    request.output_token_ids.extend(prefix)
    tracker.before_schedule(scheduler)
    assert request.spec_token_ids == []
    fault = tracker.requests["r0"].fault
    assert fault is not None and "refuses forced token" in fault


def test_greedy_drafts_only_forces_one_token_per_step_while_a_request_samples(
    codec: TokenCodec, tag: Any
) -> None:
    """Where vLLM's verify step mangles draft positions next to a randomly sampling request
    (``plugin.random_verify_is_broken``), no draft is scheduled while such a request lives."""
    from engine_adapter.serving._server_config import AdapterConfig
    from engine_adapter.vllm._tracker import SpanTracker

    answers = _Answers("42")
    tracker = SpanTracker(
        AdapterConfig(target="unix:/test.sock"),
        codec,
        max_drafts=16,
        greedy_drafts_only=True,
        runtime_factory=lambda cfg: answers,  # type: ignore[arg-type,return-value]
    )

    def params(temperature: float, structural: bool) -> SimpleNamespace:
        text = json.dumps(tag) if structural else None
        return SimpleNamespace(
            structured_outputs=SimpleNamespace(structural_tag=text),
            extra_args=None,
            temperature=temperature,
        )

    evaluated = FakeRequest("r0", params(0.0, True))
    sampling = FakeRequest("plain", params(0.8, False))
    scheduler = FakeScheduler({"r0": evaluated, "plain": sampling}, [evaluated, sampling])
    scheduler.waiting.append(object())
    tracker.add(evaluated)
    tracker.add(sampling)  # not evaluated, but it samples randomly
    evaluated.output_token_ids.extend(codec.encode_continuation(b"So <calc>6 * 7</calc>"))
    tracker.before_schedule(scheduler)
    region = tracker.requests["r0"].injector.forced_tokens()
    assert evaluated.spec_token_ids == [] and tracker.requests["r0"].plan == tuple(region[:1])
    tracker.finish("plain")
    scheduler.running.remove(sampling)
    tracker.before_schedule(scheduler)
    assert evaluated.spec_token_ids == region  # all greedy again: the region is drafted
