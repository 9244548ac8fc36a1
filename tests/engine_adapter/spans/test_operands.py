"""Operands from the context: the literals found in a text, and span grammars narrowed to them,
on XGrammar's real matcher and SmolLM2's real tokenizer."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from engine_adapter.spans._operands import (
    MAX_CANDIDATES_PER_RULE,
    MAX_LITERALS_PER_RULE,
    MAX_OPERAND_TEXT_CHARS,
    literals_in_text,
    narrow_grammar,
)

# -- literals in text (no XGrammar needed) ---------------------------------------------------


@pytest.mark.parametrize(
    ("text", "numbers"),
    [
        ("38 rows of 27 chairs and 61 more", ["38", "27", "61"]),
        ("It cost $1,250 in total.", ["1250"]),
        ("2.50 kg and 3.0 m", ["2.50", "2.5", "3.0", "3"]),
        ("It fell to -4 degrees.", ["-4", "4"]),
        ("From 5-3 the score went on", ["5", "3"]),  # a hyphen between numbers is no sign
        ("on 2024-07-04", ["2024", "07", "7", "04", "4"]),
        ("lists 1,2,3 and 12,3456", ["1", "2", "3", "12", "3456"]),
        ("version 3.14.", ["3.14"]),
        ("thirty-eight rows of twenty-seven chairs", ["38", "27"]),
        ("two hundred and five apples", ["205"]),
        ("one thousand two hundred fifty pens", ["1250"]),
        ("a dozen eggs and a hundred and twelve pens", ["12", "112"]),
        ("two dozen and five million", ["24", "5000000"]),
        ("nineteen eighty-four", ["19", "84"]),  # read aloud, two numbers
        ("Twelve. Seven", ["12", "7"]),  # punctuation ends a number
        ("someone has an apple and a cat", []),
        ("How many r's are in strawberry?", []),
    ],
)
def test_numbers_in_text_as_digits(text: str, numbers: list[str]) -> None:
    assert literals_in_text("number", text) == numbers


def test_strings_are_words_their_parts_lower_case_and_quoted_phrases() -> None:
    found = literals_in_text(
        "string", "How many r's are in \"straw berry\"? Count 'e' in Mother-in-law, <x>"
    )
    for expected in (
        '"How"',
        '"how"',
        '"r\'s"',
        '"r"',
        '"s"',
        '"straw berry"',
        '"straw"',
        '"e"',
        '"Mother-in-law"',
        '"mother-in-law"',
        '"law"',
        '"x"',
    ):
        assert expected in found
    assert len(found) == len(set(found))  # once each
    # every candidate is a JSON string that cannot spell a tag
    assert all(json.loads(s) for s in found) and not any("<" in s for s in found)
    assert '"a\\u003cb"' in literals_in_text("string", 'say "a<b"')


def test_tokens_keep_their_inner_punctuation() -> None:
    assert literals_in_text("token", "Is 978-0-306-40615-7 valid? (2024-07-04).") == [
        "Is",
        "978-0-306-40615-7",
        "valid",
        "2024-07-04",
    ]


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown literal kind"):
        literals_in_text("date", "2024-01-01")


# -- span grammars on the real matcher -------------------------------------------------------

xgr = pytest.importorskip("xgrammar")

from engine_adapter import (  # noqa: E402
    EvaluatedTagError,
    EvaluatorSpec,
    build_structural_tag,
    lower_evaluated_tags,
    narrow_to_operands,
    special_token_texts,
    standard_evaluators,
)

QUESTION = "A hall has 38 rows of 27 chairs, and 61 more chairs stand by the door. How many?"
PREFIX = "The expression is <calc>"


@functools.cache
def tokenizer() -> Any:
    from engine_adapter.local import load_tokenizer

    return load_tokenizer()


@functools.cache
def compiler() -> Any:
    info = xgr.TokenizerInfo.from_huggingface(tokenizer(), vocab_size=len(tokenizer()))
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def accepts_answer(grammar_json: str, answer: str) -> bool:
    """Whether the compiled grammar takes ``answer``'s tokens, as SmolLM2 would write them."""
    matcher = xgr.GrammarMatcher(compiler().compile_structural_tag(grammar_json))
    return all(
        matcher.accept_token(token)
        for token in tokenizer().encode(answer, add_special_tokens=False)
    )


def span_grammar(text: str | None, evaluators: list[EvaluatorSpec] | None = None) -> Any:
    return build_structural_tag(
        evaluators or standard_evaluators(),
        "grammar-eval",
        prefix=PREFIX,
        special_tokens=special_token_texts(tokenizer()),
        operands_from=text,
    )


def test_smollm2_writes_numbers_digit_by_digit() -> None:
    # the premise of the early-stop test below: "38" is two tokens, so after "3" a grammar
    # that lets a number end there lets the model write 3 for 38
    pieces = [tokenizer().decode([t]) for t in tokenizer().encode("38", add_special_tokens=False)]
    assert pieces == ["3", "8"]


def test_narrowed_span_takes_only_the_questions_numbers_complete() -> None:
    grammar = span_grammar(QUESTION)
    assert grammar.operands is not None and grammar.operands.applied
    assert dict(grammar.operands.evaluators[0].literals) == {"number": ("38", "27", "61")}
    narrowed = grammar.json()
    assert accepts_answer(narrowed, f"{PREFIX}38 * 27 + 61</calc>")
    assert accepts_answer(narrowed, f"{PREFIX}(38 + 61) * 27 - 38</calc>")  # its own operators
    assert not accepts_answer(narrowed, f"{PREFIX}3 * 27 + 61</calc>")  # stopped early
    assert not accepts_answer(narrowed, f"{PREFIX}38 * 27 + 62</calc>")  # not in the question
    assert not accepts_answer(narrowed, f"{PREFIX}17 * 23 + 91</calc>")  # the instructions'
    # without the option the same grammar takes all of them
    plain = span_grammar(None).json()
    assert span_grammar(None).operands is None
    for answer in ("3 * 27 + 61", "38 * 27 + 62", "17 * 23 + 91"):
        assert accepts_answer(plain, f"{PREFIX}{answer}</calc>")


def test_after_a_digit_only_the_rest_of_a_question_number_may_follow() -> None:
    import numpy as np

    grammar = span_grammar(QUESTION)
    matcher = xgr.GrammarMatcher(compiler().compile_structural_tag(grammar.json()))
    for token in tokenizer().encode(f"{PREFIX}3", add_special_tokens=False):
        assert matcher.accept_token(token)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer(), vocab_size=len(tokenizer()))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
    allowed = [bytes(info.decoded_vocab[i]) for i in np.flatnonzero(bits[: info.vocab_size])]
    assert allowed and all(text.startswith(b"8") for text in allowed), allowed[:10]


def test_number_words_become_their_digits() -> None:
    words = "Thirty-eight rows of twenty-seven chairs and sixty-one more. How many chairs?"
    grammar = span_grammar(words)
    assert accepts_answer(grammar.json(), f"{PREFIX}38 * 27 + 61</calc>")
    assert not accepts_answer(grammar.json(), f"{PREFIX}30 * 27 + 61</calc>")


def test_literals_outside_the_evaluators_own_rule_are_not_offered() -> None:
    # calc's number rule bounds a literal at 12 digits and 6 decimals: the option never
    # widens the evaluator's language
    text = "Add 1234567890123 to 4 and to 0.1234567."
    _, report = narrow_to_operands(standard_evaluators(["calc"]), text)
    assert dict(report.evaluators[0].literals) == {"number": ("4",)}


def test_off_with_a_reason_when_the_text_holds_no_number() -> None:
    calc = standard_evaluators(["calc"])
    grammar = span_grammar("How many r's are in strawberry?", calc)
    assert grammar.operands is not None and not grammar.operands.applied
    assert "calc: the text holds no literal its grammar accepts" in grammar.operands.reason
    assert grammar.json() == span_grammar(None, calc).json()  # the usual grammar, satisfiable
    assert accepts_answer(grammar.json(), f"{PREFIX}1 + 1</calc>")


def test_strop_words_come_from_the_text() -> None:
    text = "How many r's are in the word strawberry?"
    strop = standard_evaluators(["strop"])
    grammar = build_structural_tag(
        strop, "grammar-eval", prefix="<strop>", operands_from=text
    ).json()
    assert accepts_answer(grammar, '<strop>count("strawberry", "r")</strop>')
    assert not accepts_answer(grammar, '<strop>count("banana", "r")</strop>')
    assert not accepts_answer(grammar, '<strop>count("strawberr", "r")</strop>')


def test_a_rule_without_literals_in_the_text_keeps_its_language() -> None:
    date = standard_evaluators(["date"])
    _, report = narrow_to_operands(date, "What date is 30 days after 2024-02-10?")
    # a date's parts are numbers too (amount takes "2", not "02": its own rule decides)
    assert dict(report.evaluators[0].literals) == {
        "date": ("2024-02-10",),
        "amount": ("30", "2024", "2", "10"),
    }
    (narrowed,), partly = narrow_to_operands(date, "Add 12 days to the date.")
    assert dict(partly.evaluators[0].literals) == {"amount": ("12",)}
    assert "date left as it is" in partly.evaluators[0].reason
    assert "date ::= [0-9] [0-9] [0-9] [0-9]" in narrowed.input_grammar  # as it was
    assert 'amount ::= "12"' in narrowed.input_grammar


@pytest.mark.parametrize("spec", standard_evaluators(), ids=lambda spec: spec.name)
def test_every_standard_example_stays_writable_under_its_questions_operands(
    spec: EvaluatorSpec,
) -> None:
    from engine_adapter.spans._operands import _rule_language

    assert spec.literals, f"{spec.name} declares its literals"
    for example in spec.examples:
        (narrowed,), report = narrow_to_operands([spec], example.question)
        assert report.applied, (spec.name, example.question, report.reason)
        assert _rule_language(narrowed.input_grammar, "root")(example.input), example


def test_a_tenant_evaluator_declaring_literals_gets_the_option() -> None:
    roman = EvaluatorSpec.from_manifest(
        {
            "name": "roman",
            "tag": "roman",
            "input_grammar": "root ::= number\nnumber ::= [1-9] [0-9]? [0-9]? [0-9]?",
            "result_regex": "[IVXLCDM]+",
            "literals": {"number": "number"},
        }
    )
    plain = EvaluatorSpec.from_manifest({**roman.__dict__, "literals": {}, "examples": []})
    text = "Write the year 1994 in Roman numerals."
    grammar = build_structural_tag([roman], operands_from=text).json()
    assert accepts_answer(grammar, "<roman>1994</roman>")
    assert not accepts_answer(grammar, "<roman>1995</roman>")
    undeclared = build_structural_tag([plain], operands_from=text)
    assert undeclared.operands is not None and not undeclared.operands.applied
    assert "declares no literals" in undeclared.operands.reason


def test_many_literals_are_capped_per_rule() -> None:
    text = " ".join(str(n) for n in range(1, MAX_LITERALS_PER_RULE + 50))
    _, report = narrow_to_operands(standard_evaluators(["calc"]), text)
    assert len(report.evaluators[0].literals["number"]) == MAX_LITERALS_PER_RULE


def _calc_report(text: str) -> Any:
    _, report = narrow_to_operands(standard_evaluators(["calc"]), text)
    return report.evaluators[0]


def test_literals_are_read_from_the_first_max_operand_text_chars_only() -> None:
    filler = ("word " * MAX_OPERAND_TEXT_CHARS)[: MAX_OPERAND_TEXT_CHARS - 3].rstrip() + " "
    at_bound = filler.ljust(MAX_OPERAND_TEXT_CHARS - 2) + "38"
    assert len(at_bound) == MAX_OPERAND_TEXT_CHARS
    whole = _calc_report(at_bound)
    assert whole.literals == {"number": ("38",)} and whole.bounded == ""
    # one character more: the last numeral crosses the bound, and is read neither cut nor whole
    past = at_bound + "1"
    cut = _calc_report(past)
    assert not cut.narrowed
    assert "first" in cut.bounded and "characters" in cut.bounded


def test_each_rule_checks_at_most_max_candidates_per_rule() -> None:
    refused = [str(10**12 + i) for i in range(MAX_CANDIDATES_PER_RULE)]  # 13 digits: not calc's
    last = _calc_report(" ".join([*refused[:-1], "38"]))
    assert last.literals == {"number": ("38",)} and last.bounded == ""
    past = _calc_report(" ".join([*refused, "38"]))
    assert not past.narrowed
    assert f"the first {MAX_CANDIDATES_PER_RULE} candidates checked" in past.bounded
    assert past.checked == MAX_CANDIDATES_PER_RULE


def test_sixteen_long_literal_rules_and_a_huge_text_cost_bounded_work() -> None:
    """16 literal rules with long names and a 230 KB text of 40,000 numbers took 7.3 s to lower
    one request; the work is now bounded by the text read and the candidates per rule."""
    names = [f"number_{'n' * 24}_{i}" for i in range(16)]
    grammar = "root ::= " + " | ".join(names) + "\n"
    grammar += "".join(f'{name} ::= "0" | [1-9] [0-9]*\n' for name in names)
    text = " ".join(str(1_000 + 7 * i) for i in range(40_000))
    assert len(text) > 200_000
    narrowed, report = narrow_grammar(grammar, dict.fromkeys(names, "number"), text, "many")
    assert narrowed is not None
    assert "characters" in report.bounded
    assert report.checked <= len(names) * MAX_CANDIDATES_PER_RULE
    assert all(len(found) == MAX_LITERALS_PER_RULE for found in report.literals.values())


def test_non_ascii_literals_survive_the_grammar_cache() -> None:
    # XGrammar 0.2.7 misreads a cached literal with a non-ASCII character before a hex digit
    # ("°C"); each such character is a literal of its own
    strop = standard_evaluators(["strop"])
    grammar = build_structural_tag(
        strop, "grammar-eval", prefix="<strop>", operands_from="Count é1 in caféb1"
    ).json()
    assert accepts_answer(grammar, '<strop>count("caféb1", "é1")</strop>')


# -- the evaluated_tag request format --------------------------------------------------------


def _tag(**extra: Any) -> dict[str, Any]:
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<calc>"],
            "tags": [
                {
                    "type": "evaluated_tag",
                    "begin": "<calc>",
                    "end": "</calc>",
                    "evaluator": "calc",
                    "result": {"begin": "<result>", "end": "</result>"},
                    **extra,
                }
            ],
        },
    }


def test_evaluated_tag_takes_operands_from_per_element_or_for_all() -> None:
    specs = standard_evaluators()
    per_element = lower_evaluated_tags(_tag(operands_from=QUESTION), specs)
    for_all = lower_evaluated_tags(_tag(), specs, operands_from=QUESTION)
    assert per_element.json() == for_all.json()
    assert per_element.operands is not None and per_element.operands.applied
    assert accepts_answer(for_all.json(), "<calc>38 * 27 + 61</calc>")
    assert not accepts_answer(for_all.json(), "<calc>3 * 27 + 61</calc>")
    assert lower_evaluated_tags(_tag(), specs).operands is None


def test_evaluated_tag_refuses_operands_with_content_of_its_own() -> None:
    content = {"type": "regex", "pattern": "[0-9]+"}
    with pytest.raises(EvaluatedTagError) as caught:
        lower_evaluated_tags(_tag(operands_from=QUESTION, content=content), standard_evaluators())
    assert caught.value.path == "/format/tags/0/operands_from"
    with pytest.raises(EvaluatedTagError, match="must be a string"):
        lower_evaluated_tags(_tag(operands_from=38), standard_evaluators())
