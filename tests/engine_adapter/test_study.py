"""The accuracy study: its questions, its scoring, its statistics, and a tiny run on the real model
that writes well-formed records (accuracy and timing are never asserted)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from engine_adapter._study import (
    MODES,
    TASK_CONTENT_GRAMMAR,
    ItemRecord,
    StudyConfig,
    StudyItem,
    arithmetic_items,
    classify,
    letter_items,
    mcnemar_exact_p,
    summarize,
)
from engine_adapter._study_words import STUDY_WORDS
from evaluators_wasm.reference import reference


def test_word_list_is_real_lower_case_words_without_duplicates() -> None:
    assert len(STUDY_WORDS) >= 200
    assert len(set(STUDY_WORDS)) == len(STUDY_WORDS)
    assert all(w.isascii() and w.isalpha() and w.islower() for w in STUDY_WORDS)
    assert {"strawberry", "mississippi", "bookkeeper"} <= set(STUDY_WORDS)


def test_arithmetic_items_are_seeded_and_their_truth_is_the_evaluators() -> None:
    items = arithmetic_items(200, seed=5)
    assert items == arithmetic_items(200, seed=5)
    assert items != arithmetic_items(200, seed=6)
    assert len({item.prompt for item in items}) >= 195
    for item in items[:50]:
        p = item.params
        assert f"{p['rows']} rows of {p['items']} items, then {p['added']} more" in item.prompt
        expression = f"{p['rows']} * {p['items']} + {p['added']}"
        assert item.truth == reference("calc")(expression.encode())


def test_letter_items_are_seeded_real_words_and_counted_in_code_points() -> None:
    items = letter_items(200, seed=5)
    assert items == letter_items(200, seed=5)
    assert len({item.prompt for item in items}) == 200
    assert any(item.truth == "0" for item in items), "some letters do not occur"
    assert any(int(item.truth) >= 2 for item in items), "some letters repeat"
    for item in items:
        word, letter = item.params["word"], item.params["letter"]
        assert word in STUDY_WORDS
        assert f'the letter "{letter}" appear in the word "{word}"' in item.prompt
        call = f'count("{word}", "{letter}")'
        assert item.truth == reference("strop")(call.encode())


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


def _record(item_id: int, mode: str, correct: bool) -> ItemRecord:
    return ItemRecord(
        task="arithmetic",
        item_id=item_id,
        mode=mode,
        prompt="p",
        prefix="",
        truth="1",
        text="",
        answer="1" if correct else "2",
        correct=correct,
        failure=None if correct else "wrong_computation",
        failure_detail=None,
        extraction_ok=True,
        decode_ms=10.0,
        n_sampled=5,
    )


def test_summary_pairs_items_for_mcnemar() -> None:
    records = [_record(i, "grammar-no-eval", i < 2) for i in range(10)]
    records += [_record(i, "grammar-eval", True) for i in range(10)]
    summary = summarize(records, {"backend": "test"})
    rows = {row["mode"]: row for row in summary.rows}
    assert rows["grammar-no-eval"]["accuracy"] == 0.2
    assert rows["grammar-eval"]["wrong_computation"] == 0
    (comparison,) = summary.comparisons
    assert (comparison["only_a"], comparison["only_b"]) == (0, 8)
    assert comparison["p_value"] == pytest.approx(mcnemar_exact_p(0, 8))
    check = summary.checks["grammar_eval_correct_when_extracted"]["arithmetic"]
    assert check == {"extracted": 10, "correct": 10}
    table = summary.table_markdown()
    assert "| arithmetic | grammar-eval | 100.0% | 10 / 10 |" in table


def test_study_config_refuses_unknown_tasks_and_modes() -> None:
    with pytest.raises(ValueError, match="unknown task"):
        StudyConfig(tasks=("poetry",))
    with pytest.raises(ValueError, match="unknown mode"):
        StudyConfig(modes=("no-grammar", "shouting"))
    with pytest.raises(ValueError, match="at least one item"):
        StudyConfig(items_per_task=0)


def test_the_letters_content_grammar_compiles_and_admits_a_count_call(
    smollm2_tokenizer: Any,
) -> None:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(smollm2_tokenizer, vocab_size=49152)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(
        TASK_CONTENT_GRAMMAR["letters"]
    )
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    assert matcher.accept_string('count("strawberry", "r")')
    assert matcher.is_terminated()
    refused = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    assert not refused.accept_string("substr(")


@pytest.mark.model
def test_tiny_study_writes_well_formed_records(
    llama_backend: Any, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    from engine_adapter import InProcessWasmEvaluator
    from engine_adapter._engine import LocalEngine
    from engine_adapter._grammar import standard_evaluators
    from engine_adapter._study import run_study

    out = tmp_path / "study"
    with InProcessWasmEvaluator() as evaluator:
        engine = LocalEngine(
            llama_backend,
            smollm2_tokenizer,
            standard_evaluators(["calc", "strop"]),
            evaluator=evaluator,
        )
        config = StudyConfig(
            items_per_task=3,
            out_dir=out,
            progress=False,
            free_max_new_tokens=24,
            grammar_max_new_tokens=40,
        )
        summary = run_study(engine, config, evaluator_mode="inprocess")
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == 3 * 2 * len(MODES)
    names = {f.name for f in fields(ItemRecord)}
    seen = set()
    for line in lines:
        record = json.loads(line)
        assert set(record) == names
        seen.add((record["task"], record["item_id"], record["mode"]))
        assert isinstance(record["correct"], bool)
        assert (record["failure"] is None) == record["correct"]
        assert record["failure"] in (None, "wrong_extraction", "wrong_computation")
        assert record["backend"] == "llama" and record["evaluator_mode"] == "inprocess"
        if record["mode"] == "no-grammar":
            assert record["prefix"] == "" and record["span_content"] is None
        else:
            assert record["text"].startswith(record["prefix"]) and record["prefix"].endswith(">")
        if record["mode"] == "grammar-eval" and record["result_value"] is not None:
            # The engine forced the WASM evaluator's value, which agrees with the reference.
            assert record["result_value"] == record["span_value"]
    assert len(seen) == len(lines)
    saved = json.loads((out / "summary.json").read_text())
    assert {row["mode"] for row in saved["rows"]} == set(MODES)
    assert len(saved["comparisons"]) == 2 * 3
    assert (out / "table.md").read_text().startswith("| task | mode |")
    assert (out / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary.table_markdown() in (out / "table.md").read_text()
    # An interrupted run resumes: the finished records are kept, nothing is generated again.
    resumed = run_study(
        engine,
        StudyConfig(items_per_task=3, out_dir=out, progress=False, plot=False, resume=True),
        evaluator_mode="inprocess",
    )
    assert (out / "records.jsonl").read_text().splitlines() == lines
    assert resumed.rows == summary.rows
