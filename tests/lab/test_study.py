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

from engine_adapter._grammar import standard_evaluators
from evald_lab.study.items import (
    ARITHMETIC_TEMPLATES,
    LETTER_TEMPLATES,
    StudyItem,
    arithmetic_items,
    letter_items,
)
from evald_lab.study.run import (
    MODES,
    ItemRecord,
    StudyConfig,
    classify,
    complete_items,
    mcnemar_exact_p,
    resummarize,
    summarize,
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
    return StudyItem("arithmetic", 0, "…", "17", {"rows": 3, "items": 4, "added": 5})


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
    check = summary.checks["grammar_eval_correct_when_extracted"]["arithmetic, instructions off"]
    assert check == {"extracted": 10, "correct": 10, "wrong_computation": 0}
    assert summary.checks["grammar_eval_result_equals_reference"] == {
        "spans": 10,
        "disagreements": 0,
    }
    table = summary.table_markdown()
    row = "| arithmetic | off | grammar-eval | 10 | 100.0% | 100.0% | 100.0% (10) | 0 | 0 |"
    assert row in table


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
    # Per task: 3 mode pairs with and 3 without instructions, and 3 modes off vs on.
    assert len(saved["comparisons"]) == 2 * (3 + 3 + 3)
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
