"""The injector on SmolLM2's real tokenizer and XGrammar's real matcher, evaluating through the
real WASM modules (in process) or the Python references.

The engine loop is played by :func:`feed` / :func:`inject`: every token, sampled or forced, must be
in the matcher's bitmask and accepted by it, then is fed to the injector — exactly what the
local engine and the SGLang plugin do.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

xgr = pytest.importorskip("xgrammar")
pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engine_adapter import (  # noqa: E402
    EvalResult,
    Injector,
    InProcessWasmEvaluator,
    ReferenceEvaluator,
    SpanBinding,
    TokenCodec,
    build_structural_tag,
    special_token_texts,
    standard_evaluators,
)
from engine_adapter.local import load_tokenizer  # noqa: E402


@functools.cache
def tokenizer() -> Any:
    return load_tokenizer()


@functools.cache
def tokenizer_info() -> Any:
    return xgr.TokenizerInfo.from_huggingface(tokenizer(), vocab_size=len(tokenizer()))


@functools.cache
def codec() -> TokenCodec:
    return TokenCodec.from_tokenizer(tokenizer(), tokenizer_info=tokenizer_info())


@functools.cache
def grammar() -> Any:
    return build_structural_tag(
        standard_evaluators(), "grammar-eval", special_tokens=special_token_texts(tokenizer())
    )


@functools.cache
def compiled() -> Any:
    compiler = xgr.GrammarCompiler(tokenizer_info(), max_threads=1, cache_enabled=False)
    return compiler.compile_structural_tag(grammar().json())


@pytest.fixture(scope="module")
def wasm() -> Iterator[InProcessWasmEvaluator]:
    with InProcessWasmEvaluator(threads=2) as evaluator:
        yield evaluator


@pytest.fixture(scope="module")
def reference() -> Iterator[ReferenceEvaluator]:
    with ReferenceEvaluator() as evaluator:
        yield evaluator


def ids(text: str) -> list[int]:
    return list(tokenizer().encode(text, add_special_tokens=False))


def tid(token: str) -> int:
    """The id of one vocabulary entry, written in the tokenizer's byte-level spelling."""
    value = tokenizer().convert_tokens_to_ids(token)
    assert isinstance(value, int) and value != tokenizer().unk_token_id, token
    return value


class Run:
    """One request: a matcher and an injector fed the same tokens."""

    def __init__(self, evaluator: Any, deadline_ms: int = 5000, **options: Any) -> None:
        self.matcher = xgr.GrammarMatcher(compiled())
        self.injector = Injector(
            codec(), grammar().bindings, evaluator, deadline_ms=deadline_ms, **options
        )
        self.bitmask = xgr.allocate_token_bitmask(1, tokenizer_info().vocab_size)

    def allowed(self, token: int) -> bool:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return bool((int(self.bitmask[0, token // 32]) >> (token % 32)) & 1)

    def feed(self, tokens: list[int]) -> None:
        for token in tokens:
            assert self.allowed(token), f"token {token} {codec().token_bytes(token)!r} is masked"
            assert self.matcher.accept_token(token)
            self.injector.accept_token(token)

    def inject(self, *, one_per_step: bool = False) -> list[int]:
        """Forces the result region as an engine would; returns the forced ids."""
        forced_all: list[int] = []
        while self.injector.pending:
            forced = self.injector.forced_tokens()
            if not forced:
                self.injector.wait()
                continue
            step = forced[:1] if one_per_step else forced
            self.feed(step)
            forced_all.extend(step)
        return forced_all


def test_forced_result_tokens_are_in_the_mask_and_accepted(wasm: InProcessWasmEvaluator) -> None:
    run = Run(wasm)
    run.feed(ids("The box holds <calc>17 * 23 + 91</calc>"))
    assert run.injector.pending
    forced = run.inject()
    assert codec().decode(forced) == b"<result>482</result>"
    assert run.injector.text == "The box holds <calc>17 * 23 + 91</calc><result>482</result>"
    (span,) = run.injector.spans
    assert (span.evaluator, span.content, span.value, span.error_code) == (
        "calc", "17 * 23 + 91", "482", None)
    assert span.latency_ms is not None and span.latency_ms >= 0
    assert not run.injector.pending
    run.feed(ids(" items."))  # free text resumes after the result


@pytest.mark.parametrize(
    ("text", "region"),
    [
        ("<calc>1 / 0</calc>", "<result_error>division_by_zero</result_error>"),
        ('<strop>len("strawberry")</strop>', "<result>10</result>"),
        ('<strop>count("strawberry", "r")</strop>', "<result>3</result>"),
        ("<date>weekday(2024-02-29)</date>", "<result>Thursday</result>"),
    ],
)
def test_values_and_errors_of_each_evaluator_are_forced(
    wasm: InProcessWasmEvaluator, text: str, region: str
) -> None:
    run = Run(wasm)
    run.feed(ids(text))
    assert codec().decode(run.inject()).decode() == region


def test_non_ascii_value_forced_one_token_per_step(wasm: InProcessWasmEvaluator) -> None:
    run = Run(wasm)
    run.feed(ids('<strop>upper("é中x")</strop>'))
    run.inject(one_per_step=True)  # SGLang's way: one forced token per decode step
    assert run.injector.text.endswith('<result>"É中X"</result>')
    assert run.injector.spans[0].value == '"É中X"'


def test_model_cannot_write_a_result_before_a_span_closes(wasm: InProcessWasmEvaluator) -> None:
    run = Run(wasm)
    run.feed(ids("We know "))
    run.feed([tid("<")])
    assert not run.allowed(tid("result"))
    assert run.allowed(tid("calc"))
    assert not run.injector.pending and run.injector.forced_tokens() == []


def test_closing_tag_merged_with_the_result_opener_forces_only_the_rest(
    wasm: InProcessWasmEvaluator,
) -> None:
    run = Run(wasm)
    run.feed(ids("<calc>(2 + 3)"))
    run.feed([tid("</"), tid("calc")])
    assert not run.injector.pending, "</calc without > does not close the span"
    run.feed([tid("><")])  # one token: the span's ">" and the result's "<"
    assert run.injector.pending
    forced = run.inject()
    assert codec().decode(forced) == b"result>5</result>"
    assert run.injector.text == "<calc>(2 + 3)</calc><result>5</result>"


def test_closing_tag_split_after_a_merged_paren(wasm: InProcessWasmEvaluator) -> None:
    run = Run(wasm)
    run.feed(ids("<calc>(4 * 5"))
    run.feed([tid(")<"), tid("/"), tid("calc")])
    assert not run.injector.pending and run.injector.in_span
    run.feed([tid(">")])
    assert run.injector.pending
    run.inject()
    assert run.injector.spans[0].content == "(4 * 5)"
    assert run.injector.text.endswith("</calc><result>20</result>")


def test_span_opener_split_across_a_merged_space_token(wasm: InProcessWasmEvaluator) -> None:
    run = Run(wasm)
    run.feed(ids("So"))
    run.feed([tid("Ġ<"), tid("calc"), tid(">")])
    assert run.injector.in_span
    run.feed(ids("9 - 10</calc>"))
    run.inject()
    assert run.injector.spans[0].begin_offset == 3
    assert run.injector.text == "So <calc>9 - 10</calc><result>-1</result>"


class HeldEvaluator:
    """Real reference evaluations whose answers the test releases: pins down the timing of
    "the value is not known yet" without sleeping."""

    def __init__(self, inner: ReferenceEvaluator) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.flushes = 0

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        outer: concurrent.futures.Future[EvalResult] = concurrent.futures.Future()
        inner = self.inner.submit(evaluator, content, deadline_ms)

        def deliver() -> None:
            self.release.wait()
            outer.set_result(inner.result())

        threading.Thread(target=deliver, daemon=True).start()
        return outer

    def flush(self) -> None:
        self.flushes += 1


def test_shared_prefix_is_forced_while_the_evaluation_runs(reference: ReferenceEvaluator) -> None:
    held = HeldEvaluator(reference)
    run = Run(held)
    run.feed(ids("<calc>6 * 7</calc>"))
    early = run.injector.forced_tokens()
    assert codec().decode(early) == b"<result"
    run.feed(early)
    assert run.injector.pending and run.injector.forced_tokens() == []
    assert run.injector.wait(timeout_s=0.05) is False  # still running: nothing to force yet
    held.release.set()
    assert run.injector.wait(timeout_s=5.0) is True
    rest = run.inject()
    assert codec().decode(rest) == b">42</result>"
    assert run.injector.spans[0].waited_s > 0


def test_error_after_a_forced_prefix_continues_with_the_error_suffix(
    reference: ReferenceEvaluator,
) -> None:
    held = HeldEvaluator(reference)
    run = Run(held)
    run.feed(ids("<calc>5 % 0</calc>"))
    run.feed(run.injector.forced_tokens())
    held.release.set()
    run.inject()
    assert run.injector.text.endswith("</calc><result_error>division_by_zero</result_error>")


class UnresponsiveEvaluator:
    """Stands in for a hung evaluator or daemon (a fault a real evaluator does not produce on
    demand): its futures never complete."""

    def __init__(self) -> None:
        self.submitted: list[str] = []

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        self.submitted.append(content)
        return concurrent.futures.Future()

    def flush(self) -> None:
        pass


def test_deadline_forces_a_deadline_error_and_never_hangs() -> None:
    run = Run(UnresponsiveEvaluator(), deadline_ms=150)
    run.feed(ids("<calc>1 + 1</calc>"))
    started = time.monotonic()
    forced = run.inject()
    elapsed = time.monotonic() - started
    assert codec().decode(forced) == b"<result_error>deadline_exceeded</result_error>"
    assert elapsed < 5.0, "bounded by the deadline, with generous slack for a busy machine"
    (span,) = run.injector.spans
    assert span.error_code == "deadline_exceeded"
    assert span.latency_ms is not None and span.latency_ms >= 150
    run.feed(ids(" Moving on."))


def test_rollback_into_the_span_drops_it_and_a_new_close_resubmits(
    reference: ReferenceEvaluator,
) -> None:
    probe = UnresponsiveEvaluator()
    injector = Injector(codec(), grammar().bindings, probe, deadline_ms=1000)
    injector.accept_tokens(ids("<calc>2 + 2</calc>"))
    assert injector.pending and probe.submitted == ["2 + 2"]
    injector.rollback(3)  # "</", "calc", ">"
    assert not injector.pending and injector.in_span and injector.spans == []
    assert injector.text == "<calc>2 + 2"
    injector.accept_tokens(ids(" * 3</calc>"))
    assert probe.submitted == ["2 + 2", "2 + 2 * 3"]
    assert [s.content for s in injector.spans] == ["2 + 2 * 3"]


def test_rollback_inside_the_forced_result_forces_the_remainder_again(
    wasm: InProcessWasmEvaluator,
) -> None:
    run = Run(wasm)
    run.feed(ids("<calc>100 * 3</calc>"))
    forced = run.inject()
    assert codec().decode(forced) == b"<result>300</result>"
    run.injector.rollback(4)
    run.matcher.rollback(4)
    assert run.injector.pending
    again = run.injector.forced_tokens()
    assert again == forced[-4:]
    run.feed(again)
    assert run.injector.text.endswith("<result>300</result>")
    assert len(run.injector.spans) == 1


def test_rollback_beyond_history_is_refused() -> None:
    injector = Injector(codec(), grammar().bindings, None)
    injector.accept_tokens(ids("abc"))
    with pytest.raises(ValueError, match="cannot roll back"):
        injector.rollback(injector.num_tokens + 1)
    injector.rollback(injector.num_tokens)
    assert injector.text == "" and injector.num_tokens == 0


def test_record_only_mode_detects_spans_and_forces_nothing() -> None:
    injector = Injector(codec(), grammar().bindings, None)
    injector.accept_tokens(ids("<calc>(17 * 23) + 91</calc><result>91</result> and <strop>"))
    assert not injector.pending and injector.forced_tokens() == []
    assert [s.content for s in injector.spans] == ["(17 * 23) + 91"]
    assert injector.in_span


def test_two_spans_in_one_answer(wasm: InProcessWasmEvaluator) -> None:
    run = Run(wasm)
    run.feed(ids("First <calc>2 ** 8</calc>"))
    run.inject()
    run.feed(ids(", then <calc>256 - 6</calc>"))
    run.inject()
    assert [s.value for s in run.injector.spans] == ["256", "250"]


def test_value_outside_the_result_regex_becomes_guest_fault(wasm: InProcessWasmEvaluator) -> None:
    calc = standard_evaluators(["calc"])[0]
    natural = SpanBinding("calc", "<calc>", "</calc>", result_regex="[0-9]+")
    injector = Injector(codec(), [natural], wasm, deadline_ms=5000)
    injector.accept_tokens(ids("<calc>2 - 7</calc>"))
    assert calc.result_regex != natural.result_regex
    injector.wait()  # until the value is known
    assert codec().decode(injector.forced_tokens()) == b"<result_error>guest_fault</result_error>"


def test_auto_flush_off_still_flushes_before_waiting(reference: ReferenceEvaluator) -> None:
    held = HeldEvaluator(reference)
    injector = Injector(codec(), grammar().bindings, held, auto_flush=False)
    injector.accept_tokens(ids("<calc>1 + 2</calc>"))
    assert held.flushes == 0
    injector.wait(timeout_s=0.01)
    assert held.flushes == 1
    held.release.set()


def test_codec_encodes_any_byte_suffix_exactly() -> None:
    data = "É中X</result>".encode()
    for start in range(len(data)):
        tokens = codec().encode_continuation(data[start:])
        assert codec().decode(tokens) == data[start:]
    assert codec().encode_continuation(b"") == []


# A pool of tokens that exercises every scanner path: openers, closers, merged tokens, content.
_POOL = [
    "<", "calc", ">", "</", "><", ")<", "/", "Ġ<", "(", ")", "1", "2", "Ġ+", "Ġ", "x", "result",
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.lists(st.sampled_from(_POOL), max_size=24),
    cut=st.integers(min_value=0, max_value=24),
)
def test_rollback_restores_the_same_state_as_a_replay(tokens: list[str], cut: int) -> None:
    """Accept all, roll back to ``cut``, accept the tail again: every observable equals a fresh
    injector fed the same tokens (record-only, so no evaluation timing is involved)."""
    token_ids = [tid(t) for t in tokens]
    cut = min(cut, len(token_ids))
    rolled = Injector(codec(), grammar().bindings, None)
    rolled.accept_tokens(token_ids)
    rolled.rollback(len(token_ids) - cut)
    fresh = Injector(codec(), grammar().bindings, None)
    fresh.accept_tokens(token_ids[:cut])
    for injector in (rolled, fresh):
        assert injector.num_tokens == cut
    assert rolled.text == fresh.text
    assert rolled.in_span == fresh.in_span
    assert [s.content for s in rolled.spans] == [s.content for s in fresh.spans]
    rolled.accept_tokens(token_ids[cut:])
    replay = Injector(codec(), grammar().bindings, None)
    replay.accept_tokens(token_ids)
    assert [s.content for s in rolled.spans] == [s.content for s in replay.spans]
    assert rolled.in_span == replay.in_span


# Whole tags as well as their pieces, so that spans open and close often.
_CHUNKS = st.lists(
    st.one_of(
        st.sampled_from(_POOL).map(lambda t: [t]),
        st.sampled_from([["<", "calc", ">"], ["</", "calc", ">"], [")<", "/", "calc", ">"]]),
    ),
    max_size=8,
).map(lambda chunks: [t for chunk in chunks for t in chunk])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=_CHUNKS, drafts=_CHUNKS)
def test_draft_limit_stops_before_the_token_that_closes_a_span(
    before: list[str], drafts: list[str]
) -> None:
    """``draft_limit`` equals what feeding the drafts one by one shows: the index of the first
    draft after which one more span has closed (all of them when none closes), and it leaves
    the injector as it was."""
    prefix, draft_ids = [tid(t) for t in before], [tid(t) for t in drafts]
    injector = Injector(codec(), grammar().bindings, None)
    injector.accept_tokens(prefix)
    text, spans, in_span = injector.text, injector.span_count, injector.in_span
    limit = injector.draft_limit(draft_ids)
    assert (injector.text, injector.span_count, injector.in_span) == (text, spans, in_span)
    replay = Injector(codec(), grammar().bindings, None)
    replay.accept_tokens(prefix)
    expected = len(draft_ids)
    for index, token in enumerate(draft_ids):
        replay.accept_token(token)
        if replay.span_count > spans:
            expected = index
            break
    assert limit == expected


def test_draft_limit_is_zero_while_a_region_is_pending(reference: ReferenceEvaluator) -> None:
    held = HeldEvaluator(reference)
    run = Run(held)
    run.feed(ids("So <calc>1 + 2</calc>"))
    assert run.injector.pending
    assert run.injector.draft_limit(ids("<result>3</result>")) == 0
    assert run.injector.draft_limit([]) == 0
    held.release.set()
    fresh = Run(reference)
    fresh.feed(ids("So "))
    # A draft may open a span and write its content; it stops at the token that closes it.
    drafts = ids("<calc>1 + 2</calc>.")
    closes = next(
        i for i in range(len(drafts)) if b"</calc>" in codec().decode(drafts[: i + 1])
    )
    assert fresh.injector.draft_limit(drafts) == closes
