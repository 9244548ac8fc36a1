"""The span grammar built from the standard evaluators' manifests, on SmolLM2's real tokenizer and
XGrammar's real matcher: what the mask allows and forbids at each point of the protocol."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

xgr = pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")

from engine_adapter import (  # noqa: E402
    EvaluatorSpec,
    Mode,
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
def compiled(mode: str, prefix: str | None = None) -> Any:
    grammar = build_structural_tag(
        standard_evaluators(),
        mode,
        prefix=prefix,
        special_tokens=special_token_texts(tokenizer()),
    )
    compiler = xgr.GrammarCompiler(tokenizer_info(), max_threads=1, cache_enabled=False)
    return compiler.compile_structural_tag(grammar.json())


def ids(text: str) -> list[int]:
    return list(tokenizer().encode(text, add_special_tokens=False))


@functools.cache
def vocab() -> list[bytes]:
    return [bytes(raw) for raw in tokenizer_info().decoded_vocab]


def token_text(token_id: int) -> bytes:
    return vocab()[token_id]


def allowed_ids(matcher: Any) -> set[int]:
    """The token ids the matcher's bitmask allows next."""
    import numpy as np

    size = tokenizer_info().vocab_size
    bitmask = xgr.allocate_token_bitmask(1, size)
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].numpy().view(np.uint32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:size]
    return {int(i) for i in np.flatnonzero(bits)}


def matcher_after(text: str, mode: str = "grammar-eval") -> Any:
    matcher = xgr.GrammarMatcher(compiled(mode))
    for token in ids(text):
        assert matcher.accept_token(token), (text, token)
    return matcher


def test_standard_manifests_give_one_binding_per_evaluator() -> None:
    specs = standard_evaluators()
    grammar = build_structural_tag(specs, Mode.GRAMMAR_EVAL)
    assert {b.evaluator for b in grammar.bindings} == {s.name for s in specs}
    calc = next(b for b in grammar.bindings if b.evaluator == "calc")
    assert (calc.begin, calc.end) == ("<calc>", "</calc>")
    assert calc.result_regex == next(s for s in specs if s.name == "calc").result_regex
    fmt = json.loads(grammar.json())["format"]
    assert fmt["type"] == "triggered_tags"
    assert sorted(fmt["triggers"]) == sorted(f"<{s.tag}>" for s in specs)


def test_no_grammar_mode_has_bindings_but_no_tag() -> None:
    grammar = build_structural_tag(standard_evaluators(["calc"]), "no-grammar")
    assert grammar.structural_tag is None
    assert [b.evaluator for b in grammar.bindings] == ["calc"]
    with pytest.raises(ValueError, match="no structural tag"):
        grammar.json()


def test_free_text_can_never_spell_a_result_opener() -> None:
    matcher = matcher_after("Hello there, ")
    allowed = allowed_ids(matcher)
    assert ids("<")[0] in allowed  # a span may still open
    assert not [t for t in allowed if b"<result" in token_text(t)]
    assert matcher.accept_string("<")
    after_lt = allowed_ids(matcher)
    assert ids("calc")[0] in after_lt
    assert ids("result")[0] not in after_lt
    assert not matcher.accept_string("result")


@pytest.mark.parametrize("text", ["<|im_start|>", "<repo_name>", "</calc>", "</result>"])
def test_free_text_excludes_special_tokens_and_closers(text: str) -> None:
    matcher = matcher_after("Some text ")
    assert not matcher.accept_string(text)
    special_id = tokenizer().convert_tokens_to_ids(text)
    if isinstance(special_id, int) and special_id != tokenizer().unk_token_id:
        assert special_id not in allowed_ids(matcher_after("Some text "))


def test_end_of_sequence_is_allowed_in_free_text() -> None:
    eos = tokenizer().convert_tokens_to_ids("<|im_end|>")
    assert eos in allowed_ids(matcher_after("The answer is 4. "))
    assert eos not in allowed_ids(matcher_after("<calc>1 + "))


def test_span_content_follows_the_evaluators_input_grammar() -> None:
    matcher = matcher_after("Let me compute <calc>")
    assert not matcher.accept_string("abc")
    assert matcher.accept_string("17 * (23 + 4)")
    assert not matcher.accept_string("<r")  # only the closing tag may start with "<"
    assert matcher.accept_string("</calc>")


def test_after_the_closing_tag_only_a_result_region_may_follow() -> None:
    matcher = matcher_after("x <calc>2 + 3</calc>")
    assert matcher.find_jump_forward_string() == "<result"
    allowed = allowed_ids(matcher)
    assert allowed, "something must be allowed"
    for token in allowed:
        raw = token_text(token)
        assert b"<result>"[: len(raw)] == raw or b"<result_error>"[: len(raw)] == raw, raw


@pytest.mark.parametrize(
    ("mode", "region", "accepted"),
    [
        ("grammar-eval", "<result>482</result>", True),
        ("grammar-eval", "<result_error>division_by_zero</result_error>", True),
        ("grammar-eval", "<result>4x</result>", False),
        ("grammar-eval", "<result_error>Bad Code</result_error>", False),
        ("grammar-no-eval", "<result>91</result>", True),
        ("grammar-no-eval", "<result_error>syntax</result_error>", False),
    ],
)
def test_result_region_language(mode: str, region: str, accepted: bool) -> None:
    matcher = matcher_after("<calc>17 * 23 + 91</calc>", mode)
    assert matcher.accept_string(region) is accepted


def test_after_the_result_free_text_and_more_spans_resume() -> None:
    matcher = matcher_after("<calc>1 + 1</calc><result>2</result> and ")
    assert matcher.accept_string(' <strop>len("abc")</strop><result>3</result> done.')


def test_prefix_forces_the_opening_of_a_span() -> None:
    prefix = "The expression is <calc>"
    matcher = xgr.GrammarMatcher(compiled("grammar-eval", prefix))
    assert matcher.find_jump_forward_string() == prefix
    assert not matcher.accept_string("I think")
    assert matcher.accept_string(prefix + "3 * 4</calc><result>12</result>.")


def test_prefix_without_span_opener_is_plain_text() -> None:
    grammar = build_structural_tag(standard_evaluators(["calc"]), "grammar-eval", prefix="So: ")
    elements = grammar.structural_tag["format"]["elements"]  # type: ignore[index]
    assert elements[0] == {"type": "const_string", "value": "So: "}
    assert elements[1]["type"] == "triggered_tags"


def test_prefix_may_open_a_span_only_at_its_end() -> None:
    with pytest.raises(ValueError, match="only as its last characters"):
        build_structural_tag(standard_evaluators(["calc"]), prefix="<calc>1</calc> and")


def test_clashing_span_openers_are_refused() -> None:
    calc = standard_evaluators(["calc"])[0]
    twin = EvaluatorSpec("calc2", "calc", calc.input_grammar, calc.result_regex)
    with pytest.raises(ValueError, match="same string"):
        build_structural_tag([calc, twin])
    short = EvaluatorSpec("c", "c", calc.input_grammar, calc.result_regex)
    prefixed = EvaluatorSpec("ca", "calc", calc.input_grammar, calc.result_regex)
    build_structural_tag([short, prefixed])  # "<c>" is not a prefix of "<calc>"
    with pytest.raises(ValueError, match="no evaluators"):
        build_structural_tag([])


def test_manifest_without_grammar_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match="'broken' lacks input_grammar"):
        EvaluatorSpec.from_manifest({"name": "broken", "tag": "b", "result_regex": "x"})


def test_mode_parse_accepts_cli_and_enum_spellings() -> None:
    assert Mode.parse("grammar-no-eval") is Mode.GRAMMAR_NO_EVAL
    assert Mode.parse("GRAMMAR_EVAL") is Mode.GRAMMAR_EVAL
    with pytest.raises(ValueError, match="expected one of no-grammar"):
        Mode.parse("eval")


def test_special_token_texts_cover_smollm2_markers() -> None:
    texts = special_token_texts(tokenizer())
    assert {"<|im_start|>", "<|im_end|>", "<repo_name>"} <= set(texts)
