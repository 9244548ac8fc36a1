"""The ``evaluated_tag`` request format: lowering to plain XGrammar formats, the bindings it
yields, the excludes it adds, and errors that name the bad field."""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import pytest

xgr = pytest.importorskip("xgrammar")

from engine_adapter import (  # noqa: E402
    EvaluatedTagError,
    Injector,
    ReferenceEvaluator,
    TokenCodec,
    contains_evaluated_tag,
    lower_evaluated_tags,
    standard_evaluators,
)
from engine_adapter.local import load_tokenizer  # noqa: E402

RESULT = {"begin": "<result>", "end": "</result>"}


def calc_tag(**overrides: Any) -> dict[str, Any]:
    tag = {
        "type": "evaluated_tag",
        "begin": "<calc>",
        "end": "</calc>",
        "evaluator": "calc",
        "result": dict(RESULT),
    }
    tag.update(overrides)
    return tag


@functools.cache
def specs() -> tuple[Any, ...]:
    return tuple(standard_evaluators())


@functools.cache
def compiler() -> Any:
    tokenizer = load_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def matcher_for(tag: dict[str, Any]) -> Any:
    lowered = lower_evaluated_tags(tag, specs())
    return xgr.GrammarMatcher(compiler().compile_structural_tag(lowered.json()))


def test_evaluated_tag_inside_a_sequence_lowers_and_compiles() -> None:
    user = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "Answer: "},
                calc_tag(),
                {"type": "any_text"},
            ],
        },
    }
    original = copy.deepcopy(user)
    lowered = lower_evaluated_tags(user, specs())
    assert user == original, "the caller's tag must not be modified"
    assert not contains_evaluated_tag(lowered.structural_tag)
    (binding,) = lowered.bindings
    assert (binding.evaluator, binding.begin, binding.end) == ("calc", "<calc>", "</calc>")
    assert binding.result_regex == next(s for s in specs() if s.name == "calc").result_regex
    assert [s.name for s in lowered.evaluators] == ["calc"]
    matcher = matcher_for(user)
    assert matcher.accept_string("Answer: <calc>6 * 7</calc><result>42</result> so it is 42")


def test_default_content_is_the_evaluators_input_grammar() -> None:
    matcher = matcher_for({"type": "structural_tag", "format": calc_tag()})
    assert not matcher.accept_string("<calc>six")
    matcher = matcher_for({"type": "structural_tag", "format": calc_tag()})
    assert matcher.accept_string("<calc>6 * 7</calc>")


def test_explicit_content_replaces_the_default() -> None:
    tag = calc_tag(content={"type": "regex", "pattern": "[0-9]+ \\+ [0-9]+"})
    matcher = matcher_for({"type": "structural_tag", "format": tag})
    assert not matcher.accept_string("<calc>6 * 7")
    matcher = matcher_for({"type": "structural_tag", "format": tag})
    assert matcher.accept_string("<calc>6 + 7</calc><result>13</result>")


def test_triggered_tags_with_evaluated_tags_and_a_json_tool() -> None:
    user = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<calc>", "<tool>"],
            "tags": [
                calc_tag(),
                {
                    "type": "tag",
                    "begin": "<tool>",
                    "content": {
                        "type": "json_schema",
                        "json_schema": {
                            "type": "object",
                            "properties": {"n": {"type": "integer"}},
                            "required": ["n"],
                        },
                    },
                    "end": "</tool>",
                },
            ],
        },
    }
    matcher = matcher_for(user)
    assert matcher.accept_string(
        'x <calc>2 ** 10</calc><result>1024</result> then <tool>{"n": 1024}</tool> end'
    )
    excludes = lower_evaluated_tags(user, specs()).structural_tag["format"]["excludes"]  # type: ignore[index]
    assert "<result" in excludes and "</calc>" in excludes
    assert "<calc>" not in excludes, "a tag's own opener must stay a trigger"


def test_free_text_regions_get_the_protocol_excludes() -> None:
    user = {
        "type": "sequence",
        "elements": [{"type": "any_text"}, calc_tag(begin="<c>", end="</c>")],
    }
    lowered = lower_evaluated_tags(user, specs())
    any_text = lowered.structural_tag["format"]["elements"][0]  # type: ignore[index]
    assert {"<result", "</result", "</c>", "<c>"} <= set(any_text["excludes"])
    matcher = matcher_for(user)
    assert not matcher.accept_string("hi <result>5</result>")


def test_custom_result_and_error_regions_and_forced_tokens_are_accepted() -> None:
    tag = calc_tag(
        result={"begin": "[[", "end": "]]"},
        error={"begin": "[!", "end": "!]"},
    )
    user = {"type": "structural_tag", "format": {"type": "sequence", "elements": [tag]}}
    lowered = lower_evaluated_tags(user, specs())
    (binding,) = lowered.bindings
    assert (binding.result_begin, binding.error_end) == ("[[", "!]")
    tokenizer = load_tokenizer()
    matcher = xgr.GrammarMatcher(compiler().compile_structural_tag(lowered.json()))
    with ReferenceEvaluator(["calc"]) as evaluator:
        for expression, expected in (("6 * 7", "[[42]]"), ("1 / 0", "[!division_by_zero!]")):
            matcher.reset()
            injector = Injector(
                TokenCodec.shared(tokenizer), lowered.bindings, evaluator, deadline_ms=5000
            )
            for token in tokenizer.encode(f"<calc>{expression}</calc>", add_special_tokens=False):
                assert matcher.accept_token(token)
                injector.accept_token(token)
            while injector.pending:
                forced = injector.forced_tokens() or (injector.wait() and injector.forced_tokens())
                for token in forced:
                    assert matcher.accept_token(token), expected
                    injector.accept_token(token)
            assert injector.text.endswith(expected)
            assert matcher.accept_token(tokenizer.convert_tokens_to_ids("<|im_end|>"))
            assert matcher.is_terminated()


def test_bare_format_and_json_text_are_accepted() -> None:
    bare = lower_evaluated_tags(calc_tag(), specs())
    as_text = json.dumps({"type": "structural_tag", "format": calc_tag()})
    text = lower_evaluated_tags(as_text, specs())
    assert bare.structural_tag == text.structural_tag
    assert bare.structural_tag["type"] == "structural_tag"  # type: ignore[index]


def test_evaluator_may_be_named_by_tag_and_duplicates_share_a_binding() -> None:
    user = {"type": "sequence", "elements": [calc_tag(), {"type": "const_string", "value": " "},
                                             calc_tag()]}
    lowered = lower_evaluated_tags(user, specs())
    assert len(lowered.bindings) == 1


def test_contains_evaluated_tag() -> None:
    assert contains_evaluated_tag({"type": "sequence", "elements": [calc_tag()]})
    assert contains_evaluated_tag(json.dumps({"format": calc_tag()}))
    assert not contains_evaluated_tag({"type": "any_text"})
    assert not contains_evaluated_tag("not json")


def wrap(fmt: Any) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}


@pytest.mark.parametrize(
    ("tag", "path", "words"),
    [
        (wrap(calc_tag(evaluator="calx")), "/format/evaluator", "unknown evaluator 'calx'"),
        (wrap(calc_tag(begin="")), "/format/begin", "non-empty string"),
        (wrap(calc_tag(end=7)), "/format/end", "non-empty string"),
        (wrap({k: v for k, v in calc_tag().items() if k != "end"}), "/format/end", "missing"),
        (wrap({k: v for k, v in calc_tag().items() if k != "result"}), "/format/result",
         "missing"),
        (wrap(calc_tag(result={"begin": "<r>"})), "/format/result/end", "missing"),
        (wrap(calc_tag(result="<r>")), "/format/result", "must be an object"),
        (wrap(calc_tag(result={"begin": "<r>", "end": "</r>", "x": 1})), "/format/result/x",
         "unknown field"),
        (wrap(calc_tag(error={"begin": "<result>", "end": "</e>"})), "/format/error/begin",
         "must differ"),
        (wrap(calc_tag(colour="red")), "/format/colour", "unknown field of evaluated_tag"),
        (wrap(calc_tag(content="x")), "/format/content", "format object"),
        (wrap(calc_tag(content={"type": "regex"})), "/format/content/pattern", "Field required"),
        (wrap(calc_tag(content=calc_tag())), "/format/content", "cannot be nested"),
        (wrap({"type": "sequence", "elements": [{"type": "const_strin", "value": "x"},
                                                calc_tag()]}),
         "/format/elements/0/type", "does not match"),
        (wrap({"type": "sequence", "elements": [calc_tag(), calc_tag(end="</calc2>")]}),
         "/format/elements/1/begin", "already used with different settings at /format/elements/0"),
        (wrap({"type": "sequence", "elements": [calc_tag(begin="<c"), calc_tag(begin="<calc")]}),
         "/format/elements/1/begin", "prefix of the other"),
        ({"type": "structural_tag"}, "/format", "missing"),
        ("{not json", "/", "not valid JSON"),
        ([1, 2], "/", "expected a JSON object"),
    ],
)
def test_invalid_tags_name_the_bad_field(tag: Any, path: str, words: str) -> None:
    with pytest.raises(EvaluatedTagError) as caught:
        lower_evaluated_tags(tag, specs())
    assert caught.value.path == path, str(caught.value)
    assert words in caught.value.message
    assert str(caught.value).startswith(path)
