"""The accuracy study: its questions (seeded, several templates per task), its scoring, its
statistics, and a tiny run on the real model that writes well-formed records (accuracy and timing
are never asserted)."""

from __future__ import annotations

import json
import re
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from engine_adapter.spans._grammar import standard_evaluators
from evald_lab.study.heldout import (
    HELDOUT_ARITHMETIC_TEMPLATES,
    HELDOUT_LETTER_TEMPLATES,
    heldout_arithmetic_items,
    heldout_letter_items,
    number_in_words,
)
from evald_lab.study.items import (
    ARITHMETIC_TEMPLATES,
    LETTER_TEMPLATES,
    StudyItem,
    arithmetic_items,
    letter_items,
)
from evald_lab.study.run import (
    MODES,
    OPERANDS_ARM,
    ItemRecord,
    StudyConfig,
    classify,
    complete_items,
    items_for,
    mcnemar_exact_p,
    resummarize,
    summarize,
    wilson_interval,
)
from evald_lab.study.words import STUDY_WORDS
from evaluators_wasm.reference import reference


def test_word_list_is_real_lower_case_words_without_duplicates() -> None:
    assert len(STUDY_WORDS) >= 200
    assert len(set(STUDY_WORDS)) == len(STUDY_WORDS)
    assert all(w.isascii() and w.isalpha() and w.islower() for w in STUDY_WORDS)
    assert {"strawberry", "mississippi", "bookkeeper"} <= set(STUDY_WORDS)


def test_arithmetic_items_are_seeded_cover_every_template_and_their_truth_is_the_evaluators(
) -> None:
    items = arithmetic_items(240, seed=5)
    assert len(items) == 240
    assert items == arithmetic_items(240, seed=5)
    assert items != arithmetic_items(240, seed=6)
    assert len({item.prompt for item in items}) >= 235
    kinds = [item.template.split("/")[0] for item in items]
    assert {kind: kinds.count(kind) for kind in ARITHMETIC_TEMPLATES} == dict.fromkeys(
        ARITHMETIC_TEMPLATES, 40
    )
    templates = {item.template for item in items}
    assert templates == {
        f"{kind}/{i + 1}" for kind, wordings in ARITHMETIC_TEMPLATES.items()
        for i in range(len(wordings))
    }
    calc = reference("calc")
    for item in items:
        expression = item.params["expression"]
        assert item.truth == calc(expression.encode())
        assert int(item.truth) > 0, "every answer is a positive whole number"
        for key in "abcd":
            if key in item.params and f"{{{key}}}" in _template_text(item.template):
                assert str(item.params[key]) in item.prompt
    assert max(int(item.truth) for item in items) >= 1000, "numbers up to a few thousand"


def _template_text(template: str) -> str:
    kind, wording = template.split("/")
    return ARITHMETIC_TEMPLATES[kind][int(wording) - 1][0]


def test_letter_items_are_seeded_phrased_several_ways_and_counted_in_code_points() -> None:
    items = letter_items(200, seed=5)
    assert items == letter_items(200, seed=5)
    assert len({item.prompt for item in items}) == 200
    assert {item.template for item in items} == {
        f"phrasing/{i + 1}" for i in range(len(LETTER_TEMPLATES))
    }
    assert any(item.truth == "0" for item in items), "some letters do not occur"
    assert any(int(item.truth) >= 2 for item in items), "some letters repeat"
    for item in items:
        word, letter = item.params["word"], item.params["letter"]
        assert word in STUDY_WORDS and word in item.prompt
        call = f'count("{word}", "{letter}")'
        assert item.truth == reference("strop")(call.encode())


def test_no_study_question_is_a_manifest_example() -> None:
    """The instructions' examples are not the study's questions: the study measures problems
    worded unlike any example."""
    examples = [ex for spec in standard_evaluators() for ex in spec.examples]
    questions = {ex.question for ex in examples}
    assert questions
    prompts = {i.prompt for i in arithmetic_items(300, 1) + letter_items(300, 1)}
    assert not questions & prompts
    (strop,) = standard_evaluators(["strop"])
    words = {word for ex in strop.examples for word in re.findall(r'"([a-z]{2,})"', ex.input)}
    assert words and not words & set(STUDY_WORDS), "the letters task counts in other words"


def _arith() -> StudyItem:
    return StudyItem(
        "arithmetic", 0, "…", "17", {"a": 3, "b": 4, "c": 5, "expression": "3 * 4 + 5"}
    )


def _letters() -> StudyItem:
    return StudyItem("letters", 0, "…", "3", {"word": "strawberry", "letter": "r"})


@pytest.mark.parametrize(
    ("mode", "text", "correct", "failure"),
    [
        ("grammar-eval", "The expression is <calc>3 * 4 + 5</calc><result>17</result>", True, None),
        ("grammar-eval", "x <calc>5 + 4 * 3</calc><result>17</result>", True, None),
        ("grammar-no-eval", "x <calc>3 + 4</calc><result>7</result>", False, "wrong_extraction"),
        ("grammar-no-eval", "x <calc>3*4+5</calc><result>12</result>", False, "wrong_computation"),
        ("grammar-no-eval", "x <calc>3 * 4 + 5 * 4 * 4", False, "wrong_extraction"),
        ("grammar-no-eval", "x <calc>3 * 4 + 5</calc><res", False, "wrong_computation"),
        ("no-grammar", "3 * 4 = 12, and 12 + 5 = 17.", True, None),
        ("no-grammar", "3 * 4 = 13, so 13 + 5 = 18 items.", False, "wrong_computation"),
        ("no-grammar", "3 + 4 = 7, so there are 7 items.", False, "wrong_extraction"),
        ("no-grammar", "There are many items.", False, "wrong_extraction"),
    ],
)
def test_arithmetic_scoring(mode: str, text: str, correct: bool, failure: str | None) -> None:
    verdict = classify(_arith(), mode, text)
    assert verdict["correct"] is correct
    assert verdict["failure"] == failure
    if correct:
        assert verdict["answer"] == "17"


def test_letter_scoring_checks_the_question_not_just_the_value() -> None:
    item = _letters()
    right = classify(
        item, "grammar-eval", 'x <strop>count("strawberry", "r")</strop><result>3</result>'
    )
    assert right["correct"] and right["extraction_ok"]
    # Same value, other letter: the answer is right by luck, the extraction is not.
    lucky = classify(
        item, "grammar-eval", 'x <strop>count("berrry", "r")</strop><result>3</result>'
    )
    assert lucky["correct"] and lucky["extraction_ok"] is False
    miscounted = classify(
        item, "grammar-no-eval", 'x <strop>count("strawberry", "r")</strop><result>2</result>'
    )
    assert miscounted["failure"] == "wrong_computation"
    assert miscounted["span_value"] == "3" and miscounted["result_value"] == "2"
    wrong_word = classify(
        item, "grammar-eval", 'x <strop>count("r", "r")</strop><result>1</result>'
    )
    assert wrong_word["failure"] == "wrong_extraction"
    free = classify(item, "no-grammar", 'The letter "r" appears 2 times in "strawberry".')
    assert free["failure"] == "wrong_computation" and free["answer"] == "2"


def _heldout_arith(distractor: int | None = None) -> StudyItem:
    params = {"a": 38, "b": 27, "c": 61, "expression": "38 * 27 + 61", "distractor": distractor}
    prompt = "Thirty-eight rows of 27 chairs and 61 more. The hall was built in 1987."
    return StudyItem("arithmetic", 0, prompt, "1087", params)


@pytest.mark.parametrize(
    ("mode", "text", "cause"),
    [
        ("grammar-eval", "<calc>38 * 27 + 61</calc><result>1087</result>", None),
        ("grammar-eval", "<calc>61 + 27 * 38</calc><result>1087</result>", None),
        ("grammar-eval", "<calc>3 * 27 + 61</calc><result>142</result>", "wrong_operands"),
        ("grammar-eval", "<calc>17 * 23 + 91</calc><result>482</result>", "wrong_operands"),
        ("grammar-eval", "<calc>38 * 61 + 27</calc><result>2345</result>", "wrong_structure"),
        ("grammar-eval", "<calc>38 * 27 - 61</calc><result>965</result>", "wrong_structure"),
        ("grammar-eval", "<calc>38 * 27 * 61 * 38 * 27", "span_not_closed"),
        (OPERANDS_ARM, "<calc>38 / (27 - 27) + 61</calc><result_error>division_by_zero"
                       "</result_error>", "evaluator_error"),
        ("grammar-no-eval", "<calc>38 * 27 + 61</calc><result>1000</result>",
         "wrong_computation"),
        ("no-grammar", "There are many chairs.", "no_number"),
        ("no-grammar", "There are 1000 chairs.", "wrong_number"),
    ],
)
def test_failure_causes(mode: str, text: str, cause: str | None) -> None:
    verdict = classify(_heldout_arith(), mode, text)
    assert verdict["cause"] == cause
    assert verdict["correct"] is (cause is None)


def test_letter_failure_causes_tell_operands_from_structure() -> None:
    item = _letters()
    swapped = classify(item, "grammar-eval", '<strop>count("r", "strawberry")</strop><result>0'
                       "</result>")
    assert swapped["cause"] == "wrong_structure"
    other = classify(item, "grammar-eval", '<strop>count("straw", "r")</strop><result>1</result>')
    assert other["cause"] == "wrong_operands"
    length = classify(item, "grammar-eval", '<strop>len("strawberry")</strop><result>10</result>')
    assert length["cause"] == "wrong_operands"  # the letter is missing


def test_a_span_using_the_distractor_is_flagged() -> None:
    item = _heldout_arith(distractor=1987)
    used = classify(item, "grammar-eval", "<calc>38 * 27 + 1987</calc><result>3013</result>")
    assert used["distractor_used"] is True and used["cause"] == "wrong_operands"
    clean = classify(item, "grammar-eval", "<calc>38 * 27 + 61</calc><result>1087</result>")
    assert clean["distractor_used"] is False
    assert classify(_heldout_arith(), "grammar-eval", "<calc>1</calc><result>1</result>")[
        "distractor_used"] is None
    assert classify(item, "grammar-eval", "<calc>38 * 27")["distractor_used"] is None


def test_a_span_using_a_literal_the_question_does_not_hold_is_flagged() -> None:
    item = _heldout_arith()
    # the question's numbers as the operands option reads them: words as digits
    own = classify(item, "grammar-eval", "<calc>38 * 27 + 1987</calc><result>3013</result>")
    assert own["foreign_operands"] is False
    foreign = classify(item, "grammar-eval", "<calc>17 * 23 + 91</calc><result>482</result>")
    assert foreign["foreign_operands"] is True
    assert classify(item, "grammar-eval", "no span")["foreign_operands"] is None
    words = classify(_letters_in("Count the r's in strawberry."), "grammar-eval",
                     '<strop>count("strawberry", "r")</strop><result>3</result>')
    assert words["foreign_operands"] is False
    other = classify(_letters_in("Count the r's in strawberry."), "grammar-eval",
                     '<strop>count("cocoa", "o")</strop><result>2</result>')
    assert other["foreign_operands"] is True


def _letters_in(prompt: str) -> StudyItem:
    return StudyItem("letters", 0, prompt, "3", {"word": "strawberry", "letter": "r"})


def test_wilson_interval_matches_known_values() -> None:
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)
    assert wilson_interval(10, 10) == pytest.approx((0.72247, 1.0), abs=1e-5)
    assert wilson_interval(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    low, high = wilson_interval(29, 200)
    assert low < 29 / 200 < high and high - low < 0.1
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_number_in_words_reads_back_as_its_digits() -> None:
    from engine_adapter.spans._operands import literals_in_text

    assert number_in_words(38) == "thirty-eight"
    assert number_in_words(205) == "two hundred and five"
    assert number_in_words(2641) == "two thousand six hundred and forty-one"
    assert number_in_words(3007) == "three thousand and seven"
    for n in (0, 7, 13, 40, 99, 100, 101, 999, 1000, 1010, 4119, 99999):
        assert literals_in_text("number", f"We have {number_in_words(n)} pens.") == [str(n)], n


def test_heldout_arithmetic_items_vary_wording_numbers_and_distractors() -> None:
    items = heldout_arithmetic_items(240, seed=5)
    assert items == heldout_arithmetic_items(240, seed=5) != heldout_arithmetic_items(240, 6)
    kinds = [item.template.split("/")[0] for item in items]
    assert {kind: kinds.count(kind) for kind in HELDOUT_ARITHMETIC_TEMPLATES} == dict.fromkeys(
        HELDOUT_ARITHMETIC_TEMPLATES, 40
    )
    words = [item for item in items if item.params["words"]]
    distracted = [item for item in items if item.params["distractor"] is not None]
    assert 50 <= len(words) <= 110 and 50 <= len(distracted) <= 110
    calc = reference("calc")
    from engine_adapter.spans._operands import literals_in_text

    for item in items:
        assert calc(item.params["expression"].encode()) == item.truth
        numbers = literals_in_text("number", item.prompt)
        # every operand can be read off the question (words as digits), so the operands
        # option can offer it; a distractor is read too, and is never an operand or the answer
        assert {str(n) for n in item.params["operands"]} <= set(numbers), item.prompt
        if item.params["words"]:
            assert not re.search(r"[0-9]", item.prompt), item.prompt
        distractor = item.params["distractor"]
        if distractor is not None:
            assert str(distractor) in numbers
            assert distractor not in item.params["operands"] and str(distractor) != item.truth
    # the question comes first in some wordings: not every prompt ends with its question
    assert any(item.prompt.startswith(("How", "What", "Find")) for item in items)


def test_heldout_letter_items_and_their_distractor_words() -> None:
    items = heldout_letter_items(200, seed=5)
    assert items == heldout_letter_items(200, seed=5)
    assert {item.template.split("/")[0] + "/" + item.template.split("/")[1] for item in items} == {
        f"phrasing/{i + 1}" for i in range(len(HELDOUT_LETTER_TEMPLATES))}
    distracted = [item for item in items if item.params["distractor"] is not None]
    assert 40 <= len(distracted) <= 100
    for item in items:
        assert item.truth == str(item.params["word"].count(item.params["letter"]))
        assert item.params["word"] in item.prompt
        if item.params["distractor"]:
            assert item.params["distractor"] != item.params["word"]
            assert item.params["distractor"] in item.prompt


def test_heldout_questions_are_worded_unlike_the_original_set_and_the_examples() -> None:
    examples = {ex.question for spec in standard_evaluators() for ex in spec.examples}
    original = [text for wordings in ARITHMETIC_TEMPLATES.values() for text, _ in wordings]
    original += list(LETTER_TEMPLATES)
    heldout = [text for wordings in HELDOUT_ARITHMETIC_TEMPLATES.values() for text, _ in wordings]
    heldout += list(HELDOUT_LETTER_TEMPLATES)

    def skeleton(text: str) -> str:
        return re.sub(r"\{\w+\}", "#", text)

    assert not {skeleton(t) for t in heldout} & {skeleton(t) for t in original}
    # no two templates share a run of five words: the wordings are new, not reshuffled
    def runs(text: str) -> set[tuple[str, ...]]:
        words = re.findall(r"[a-z']+", skeleton(text).lower())
        return {tuple(words[i : i + 5]) for i in range(len(words) - 4)}

    old_runs = set().union(*(runs(t) for t in original))
    assert not any(runs(t) & old_runs for t in heldout)
    prompts = {i.prompt for i in items_for("heldout", "arithmetic", 300, 1)}
    prompts |= {i.prompt for i in items_for("heldout", "letters", 300, 1)}
    assert not prompts & examples


def test_mcnemar_exact_p_matches_the_binomial_tail() -> None:
    assert mcnemar_exact_p(0, 0) == 1.0
    assert mcnemar_exact_p(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact_p(0, 6) == pytest.approx(2 / 64)
    assert mcnemar_exact_p(1, 9) == pytest.approx(2 * 11 / 1024)
    assert mcnemar_exact_p(9, 1) == mcnemar_exact_p(1, 9)
    assert mcnemar_exact_p(5, 5) == 1.0
    assert 0 < mcnemar_exact_p(20, 60) < 1e-5


def _record(
    item_id: int, mode: str, correct: bool, *, instructions: bool = False
) -> ItemRecord:
    return ItemRecord(
        task="arithmetic",
        item_id=item_id,
        mode=mode,
        instructions=instructions,
        template="sum/1",
        prompt="p",
        prefix="",
        truth="1",
        text="",
        answer="1" if correct else "2",
        correct=correct,
        failure=None if correct else "wrong_computation",
        cause=None if correct else "wrong_computation",
        failure_detail=None,
        extraction_ok=True,
        span_content="1" if mode != "no-grammar" else None,
        span_value="1" if correct else "2",
        result_value="1" if correct else "2",
        decode_ms=10.0,
        n_sampled=5,
    )


def test_summary_pairs_items_for_mcnemar() -> None:
    records = [_record(i, "grammar-no-eval", i < 2) for i in range(10)]
    records += [_record(i, "grammar-eval", True) for i in range(10)]
    summary = summarize(records, {"backend": "test"})
    rows = {row["mode"]: row for row in summary.rows}
    assert rows["grammar-no-eval"]["accuracy"] == 0.2
    assert rows["grammar-no-eval"]["span_rate"] == 1.0
    assert rows["grammar-eval"]["wrong_computation"] == 0
    (comparison,) = summary.comparisons
    assert (comparison["only_a"], comparison["only_b"]) == (0, 8)
    assert comparison["p_value"] == pytest.approx(mcnemar_exact_p(0, 8))
    checks = summary.checks["grammar_eval_correct_when_extracted"]
    check = checks["arithmetic, grammar-eval, instructions off"]
    assert check == {"extracted": 10, "correct": 10, "wrong_computation": 0}
    assert summary.checks["grammar_eval_result_equals_reference"] == {
        "spans": 10,
        "disagreements": 0,
    }
    table = summary.table_markdown()
    row = (
        "| arithmetic | off | grammar-eval | 10 | 100.0% | 100.0% | 100.0% (10) | "
        "72.2-100.0% | 0 | 0 |"
    )
    assert row in table
    assert rows["grammar-no-eval"]["accuracy_ci95"] == pytest.approx(list(wilson_interval(2, 10)))
    assert rows["grammar-no-eval"]["causes"] == {"wrong_computation": 8}
    assert "| arithmetic | off | grammar-no-eval | 8 | 8 (100%) |" in table


def test_summary_compares_with_and_without_instructions_and_flags_engine_disagreement() -> None:
    records = [_record(i, "grammar-eval", i < 3) for i in range(8)]
    records += [_record(i, "grammar-eval", i < 7, instructions=True) for i in range(8)]
    records[0] = replace(records[0], result_value="7")  # the engine forced another value
    summary = summarize(records, {})
    (comparison,) = summary.comparisons
    assert comparison["a"] == "grammar-eval (off)" and comparison["b"] == "grammar-eval (on)"
    assert (comparison["only_a"], comparison["only_b"]) == (0, 4)
    assert summary.checks["grammar_eval_result_equals_reference"]["disagreements"] == 1
    per_template = {(t["instructions"], t["template"]): t["n"] for t in summary.by_template}
    assert per_template == {(False, "sum/1"): 8, (True, "sum/1"): 8}


def test_complete_items_keeps_only_items_run_in_every_condition() -> None:
    records = [_record(i, mode, True) for i in range(4) for mode in ("no-grammar", "grammar-eval")]
    records += [_record(i, "grammar-eval", True, instructions=True) for i in range(3)]
    kept = complete_items(records)
    assert {r.item_id for r in kept} == {0, 1, 2}
    assert len(kept) == 9


def test_study_config_refuses_unknown_tasks_and_modes() -> None:
    with pytest.raises(ValueError, match="unknown task"):
        StudyConfig(tasks=("poetry",))
    with pytest.raises(ValueError, match="unknown mode"):
        StudyConfig(modes=("no-grammar", "shouting"))
    with pytest.raises(ValueError, match="at least one item"):
        StudyConfig(items_per_task=0)
    with pytest.raises(ValueError, match="instructions"):
        StudyConfig(instructions=())


@pytest.mark.model
def test_tiny_study_writes_well_formed_records(
    llama_backend: Any, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    from engine_adapter import InProcessWasmEvaluator, render_instructions
    from engine_adapter.local import LocalEngine
    from evald_lab.study.run import INSTRUCTION_LEAD, run_study

    out = tmp_path / "study"
    with InProcessWasmEvaluator() as evaluator:
        engine = LocalEngine(
            llama_backend,
            smollm2_tokenizer,
            standard_evaluators(),
            evaluator=evaluator,
        )
        config = StudyConfig(
            items_per_task=2,
            out_dir=out,
            progress=False,
            free_max_new_tokens=16,
            grammar_max_new_tokens=24,
        )
        summary = run_study(engine, config, evaluator_mode="inprocess")
        assert engine.system_prompt is None, "the engine's system prompt is restored"
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * len(MODES) * 2
    names = {f.name for f in fields(ItemRecord)}
    seen = set()
    for line in lines:
        record = json.loads(line)
        assert set(record) == names
        seen.add((record["instructions"], record["task"], record["item_id"], record["mode"]))
        assert isinstance(record["correct"], bool)
        assert (record["failure"] is None) == record["correct"]
        assert record["failure"] in (None, "wrong_extraction", "wrong_computation")
        assert record["backend"] == "llama" and record["evaluator_mode"] == "inprocess"
        assert record["template"] and record["model"] == "smollm2"
        if record["mode"] == "no-grammar":
            assert record["prefix"] == ""
        else:
            assert record["text"].startswith(record["prefix"]) and record["prefix"].endswith(">")
        if record["mode"] == "grammar-eval" and record["result_value"] is not None:
            # The engine forced the WASM evaluator's value, which agrees with the reference.
            assert record["result_value"] == record["span_value"]
    assert len(seen) == len(lines)
    # The instructions the model saw are the rendered manifests, kept beside the results.
    assert (out / "instructions.txt").read_text() == render_instructions(
        standard_evaluators(), answer_prefix=INSTRUCTION_LEAD
    )
    saved = json.loads((out / "summary.json").read_text())
    assert {(row["instructions"], row["mode"]) for row in saved["rows"]} == {
        (flag, mode) for flag in (False, True) for mode in MODES
    }
    # Per task: 6 arm pairs with and 6 without instructions, and 4 arms off vs on.
    assert len(saved["comparisons"]) == 2 * (6 + 6 + 4)
    operands = [json.loads(line) for line in lines]
    for record in operands:
        # only the operands arm narrows, and it says what its evaluator could use
        assert (record["operands"] is not None) == (record["mode"] == OPERANDS_ARM)
        if record["mode"] == OPERANDS_ARM and record["task"] == "arithmetic":
            numbers = set(re.findall(r"[0-9]+", record["prompt"]))
            assert set(record["operands"]["literals"]["number"]) <= numbers
    assert (out / "table.md").read_text().startswith("| task | instructions | mode |")
    assert (out / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary.table_markdown() in (out / "table.md").read_text()
    # Re-scoring from the records alone gives the same table.
    assert resummarize(out, plot=False).rows == summary.rows
    # An interrupted run resumes: the finished records are kept, nothing is generated again.
    resumed = run_study(
        engine,
        StudyConfig(items_per_task=2, out_dir=out, progress=False, plot=False, resume=True),
        evaluator_mode="inprocess",
    )
    assert (out / "records.jsonl").read_text().splitlines() == lines
    assert resumed.rows == summary.rows
