"""Computed properties on SmolLM2's real tokenizer and XGrammar's real matcher, evaluated by the
Python references or the real WASM modules in process.

The engine loop is played by :class:`Run`: every token, written or forced, must be accepted by the
matcher compiled from the lowered schema, then is fed to the state — what the engines do.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

xgr = pytest.importorskip("xgrammar")
pytest.importorskip("torch")

import jsonschema  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engine_adapter import (  # noqa: E402
    ComputedFieldsState,
    EvalResult,
    InProcessWasmEvaluator,
    ReferenceEvaluator,
    TokenCodec,
    standard_evaluators,
)
from engine_adapter.local import load_tokenizer  # noqa: E402
from engine_adapter.spans import ERROR_SCHEMA, EvaluatorSpec, lower_computed_schema  # noqa: E402

ESSAY = {
    "type": "object",
    "properties": {
        "expression": {"type": "string"},
        "answer": {"type": "number", "computed": {"by": "calc", "from": "/expression"}},
    },
    "required": ["expression", "answer"],
}


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
def _compiled(tag_json: str) -> Any:
    compiler = xgr.GrammarCompiler(tokenizer_info(), max_threads=1, cache_enabled=False)
    return compiler.compile_structural_tag(tag_json)


@pytest.fixture(scope="module")
def reference() -> Iterator[ReferenceEvaluator]:
    with ReferenceEvaluator() as evaluator:
        yield evaluator


def ids(text: str) -> list[int]:
    return [int(t) for t in tokenizer().encode(text, add_special_tokens=False)]


class Run:
    """One request: the lowered grammar's matcher and the computed-fields state, fed together."""

    def __init__(
        self,
        schema: Mapping[str, Any],
        evaluator: Any,
        *,
        deadline_ms: int = 5000,
        evaluators: list[EvaluatorSpec] | None = None,
        operands_from: str | None = None,
    ) -> None:
        self.grammar = lower_computed_schema(
            schema, evaluators or standard_evaluators(), operands_from=operands_from
        )
        assert self.grammar.computed is not None
        self.matcher = xgr.GrammarMatcher(_compiled(self.grammar.json()))
        self.state = ComputedFieldsState(
            codec(), self.grammar.computed, evaluator, deadline_ms=deadline_ms
        )

    def feed(self, tokens: list[int]) -> None:
        for token in tokens:
            assert self.matcher.accept_token(token), (
                f"the grammar refuses {codec().decode([token])!r} after {self.state.text!r}"
            )
            self.state.accept_token(token)

    def write(self, text: str) -> None:
        """The model writes ``text`` (token by token, as sampled), then whatever is forced."""
        self.feed(ids(text))
        self.inject()

    def inject(self) -> list[int]:
        forced: list[int] = []
        while self.state.pending:
            tokens = self.state.forced_tokens()
            if not tokens:
                self.state.wait(timeout_s=10.0)
                continue
            forced += tokens
            self.feed(tokens)
        return forced

    def document(self) -> Any:
        assert self.matcher.accept_token(tokenizer().eos_token_id), self.state.text
        assert self.matcher.is_terminated()
        return json.loads(self.state.text)


def test_the_essays_example_forces_the_value_and_the_text_before_it(
    reference: ReferenceEvaluator,
) -> None:
    run = Run(ESSAY, reference)
    run.feed(ids('{"expression": "17 * 23 + 91"'))
    forced = run.inject()
    assert codec().decode(forced) == b', "answer": 482}'
    assert run.document() == {"expression": "17 * 23 + 91", "answer": 482}
    (record,) = run.state.spans
    assert (record.field, record.evaluator, record.content) == ("/answer", "calc", "17 * 23 + 91")
    assert record.value == "482" and record.injected == "482"


def test_wasm_policy_style_object_input_and_object_value() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "array", "items": {"type": "integer"}},
            "sum": {
                "type": "object",
                "properties": {"value": {"type": "integer"}},
                "computed": {"by": "calc", "from": "/a"},
            },
            "reply": {"type": "string"},
        },
        "required": ["a", "b", "reply"],
    }
    with InProcessWasmEvaluator(threads=1) as wasm:
        run = Run(schema, wasm)
        run.write('{"a": 6, "b": [1, 2]')
        run.write(', "reply": "ok"}')
    document = run.document()
    # calc answers a number, which the object property cannot hold: an error, valid JSON.
    assert document["sum"] == {"$error": "schema_mismatch"}
    assert run.state.spans[0].content == "6"
    assert "does not fit" in run.state.spans[0].result.message  # type: ignore[union-attr]


def test_several_nested_and_chained_computed_properties(reference: ReferenceEvaluator) -> None:
    schema = {
        "type": "object",
        "properties": {
            "inner": {
                "type": "object",
                "properties": {
                    "x": {"type": "string"},
                    "y": {"type": "integer", "computed": {"by": "calc", "from": "/inner/x"}},
                },
            },
            "twice": {"type": "string", "computed": {"by": "calc", "from": "/inner/x"}},
            "e": {"type": "string"},
            "z": {"type": "number", "computed": {"by": "calc", "from": "/e"}},
            "n": {"type": "integer", "computed": {"by": "calc", "from": "/z"}},
        },
        "required": ["inner", "e"],
    }
    run = Run(schema, reference)
    run.write('{"inner": {"x": "6 * 7"')
    run.write(', "e": "2 + 3"')
    assert run.document() == {
        "inner": {"x": "6 * 7", "y": 42},
        "twice": "42",  # not JSON a string holds: the text as a string
        "e": "2 + 3",
        "z": 5,
        "n": 5,  # computed from a computed value
    }
    assert [r.field for r in run.state.spans] == ["/inner/y", "/twice", "/z", "/n"]


def test_an_error_is_forced_as_the_error_object(reference: ReferenceEvaluator) -> None:
    run = Run(ESSAY, reference)
    run.write('{"expression": "1 / 0"')
    document = run.document()
    assert document == {"expression": "1 / 0", "answer": {"$error": "division_by_zero"}}
    lowered = run.grammar.computed.schema  # type: ignore[union-attr]
    jsonschema.validate(document, lowered)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, ESSAY)  # only the documented alternative extends it


class HeldEvaluator:
    """Real reference evaluations whose answers the test releases: pins down "the value is not
    known yet" without sleeping."""

    def __init__(self, inner: ReferenceEvaluator) -> None:
        self.inner = inner
        self.release = threading.Event()

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
        pass


def test_the_text_before_the_value_is_forced_while_it_is_computed(
    reference: ReferenceEvaluator,
) -> None:
    held = HeldEvaluator(reference)
    run = Run(ESSAY, held)
    run.feed(ids('{"expression": "6 * 7"'))
    early = run.state.forced_tokens()
    assert codec().decode(early) == b', "answer": '
    run.feed(early)
    assert run.state.pending and not run.state.result_known
    assert run.state.forced_tokens() == []
    assert run.state.wait(timeout_s=0.05) is False
    held.release.set()
    assert codec().decode(run.inject()) == b"42}"


class UnresponsiveEvaluator:
    """Stands in for a hung daemon (a fault a real evaluator does not produce on demand)."""

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        return concurrent.futures.Future()

    def flush(self) -> None:
        pass


def test_a_late_value_is_a_deadline_error_and_the_document_stays_valid() -> None:
    run = Run(ESSAY, UnresponsiveEvaluator(), deadline_ms=100)
    run.write('{"expression": "1 + 1"')
    assert run.document()["answer"] == {"$error": "deadline_exceeded"}
    assert run.state.spans[0].error_code == "deadline_exceeded"


def test_give_up_ends_the_value_in_band() -> None:
    run = Run(ESSAY, UnresponsiveEvaluator())
    run.feed(ids('{"expression": "1 + 1"'))
    run.state.give_up("the step cannot wait")
    run.inject()
    assert run.document()["answer"] == {"$error": "deadline_exceeded"}


def test_rollback_forgets_a_due_value_and_a_new_one_resubmits(
    reference: ReferenceEvaluator,
) -> None:
    run = Run(ESSAY, reference)
    written = ids('{"expression": "2 + 2"')
    run.feed(written)
    assert run.state.span_count == 1
    run.state.rollback(1)
    assert run.state.span_count == 0 and not run.state.pending
    run.matcher.rollback(1)
    run.write(codec().decode(written[-1:]).decode())
    assert run.document() == {"expression": "2 + 2", "answer": 4}
    assert run.state.span_count == 1


def test_draft_limit_cuts_before_the_token_that_makes_a_value_due() -> None:
    run = Run(ESSAY, UnresponsiveEvaluator())
    drafts = ids('{"expression": "2 + 2"')
    limit = run.state.draft_limit(drafts)
    assert limit == len(drafts) - 1  # the closing quote's token is the one
    assert run.state.span_count == 0  # pure: nothing submitted


def test_extracted_properties_offer_only_the_texts_literals(reference: ReferenceEvaluator) -> None:
    schema = {
        "type": "object",
        "properties": {
            "age": {"anyOf": [{"type": "integer"}, {"type": "null"}], "extracted": True},
            "prices": {"type": "array", "items": {"type": "number"}, "extracted": True},
        },
        "required": ["age", "prices"],
    }
    text = "My daughter is 12 and I'm forty-six; the two rooms cost £6,500 and 1200 pounds."
    run = Run(schema, reference, operands_from=text)
    run.feed(ids('{"age": '))
    allowed = xgr.allocate_token_bitmask(1, tokenizer_info().vocab_size)
    run.matcher.fill_next_token_bitmask(allowed)
    assert not run.matcher.accept_string("13")
    run.write('46, "prices": [6500, 1200]}')
    assert json.loads(run.state.text) == {"age": 46, "prices": [6500, 1200]}
    report = run.grammar.operands
    assert report is not None and report.applied
    literals = {k: v for e in report.evaluators for k, v in e.literals.items()}
    assert literals["/properties/age/anyOf/0"] == ("12", "46", "2", "6500", "1200")


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    note=st.text(alphabet=st.sampled_from(list('ab {}[]:,"\\/\tx0')), min_size=0, max_size=12),
    a=st.integers(min_value=0, max_value=10**6),
    b=st.integers(min_value=1, max_value=999),
)
def test_text_that_looks_like_structure_never_moves_the_value(
    reference: ReferenceEvaluator, note: str, a: int, b: int
) -> None:
    """A string holding braces, quotes, escapes or ``"answer": `` is content, not structure."""
    schema = {
        "type": "object",
        "properties": {
            "note": {"type": "string"},
            "deep": {"type": "object", "properties": {"k": {"type": "string"}}},
            "expression": {"type": "string"},
            "answer": {"type": "integer", "computed": {"by": "calc", "from": "/expression"}},
            "after": {"type": "string"},
        },
        "required": ["note", "deep", "expression", "after"],
    }
    run = Run(schema, reference)
    note_json = json.dumps(note + ' "answer": 1', ensure_ascii=False)
    run.write(f'{{"note": {note_json}, "deep": {{"k": {note_json}}}, "expression": "{a} + {b}"')
    run.write(' "after": "x"}')  # the forced ',' ends the number
    document = run.document()
    assert document["answer"] == a + b
    jsonschema.validate(document, run.grammar.computed.schema)  # type: ignore[union-attr]


def test_the_error_alternative_is_the_documented_one() -> None:
    assert ERROR_SCHEMA["required"] == ["$error"]
    grammar = lower_computed_schema(ESSAY, standard_evaluators())
    answer = grammar.computed.schema["properties"]["answer"]  # type: ignore[union-attr]
    assert answer == {"anyOf": [{"type": "number"}, dict(ERROR_SCHEMA)]}
    assert grammar.computed.schema["required"] == ["expression", "answer"]  # type: ignore[union-attr]


class OddCodeEvaluator:
    """Stands in for an evaluator that answers an error code outside the codes' language (a
    fault evald itself never produces)."""

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        done: concurrent.futures.Future[EvalResult] = concurrent.futures.Future()
        done.set_result(EvalResult(None, "Not A Code!", "odd"))
        return done

    def flush(self) -> None:
        pass


def test_an_error_code_outside_the_codes_language_is_forced_as_internal() -> None:
    run = Run(ESSAY, OddCodeEvaluator())
    run.write('{"expression": "1 + 1"')
    assert run.document()["answer"] == {"$error": "internal"}
