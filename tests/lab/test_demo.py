"""The `make run` demo section runs against a real daemon and shows real values."""

from __future__ import annotations

import io

import pytest
from daemon_harness import Daemon
from rich.console import Console

from evald_lab.demo import EXAMPLES, show_evaluations


def test_demo_shows_evaluations_through_evald_call(daemon: Daemon) -> None:
    buffer = io.StringIO()
    show_evaluations(daemon.target, Console(file=buffer, width=200))
    text = buffer.getvalue()
    served = {info.name for info in daemon.client().list_evaluators()}
    assert "evaluators served:" in text
    if "calc" in served:
        assert "482" in text
        assert "error: division_by_zero" in text
    for name in {name for name, _ in EXAMPLES} - served:
        assert name in text.split("skipped (not built):")[1]


def test_the_demo_runs_the_configuration_the_study_found_best() -> None:
    """The demo's configuration is the arm with the most right answers (both tasks together) in
    the committed held-out study of its model, with the instructions on."""
    import json
    from pathlib import Path

    from evald_lab.demo import BEST_CONFIGURATION
    from evald_lab.study.run import OPERANDS_ARM

    summary = json.loads((Path(__file__).parents[2] / BEST_CONFIGURATION.study).read_text())
    assert summary["config"]["model"] == "smollm2"
    assert summary["config"]["problems"] == "heldout"
    correct: dict[tuple[bool, str], int] = {}
    for row in summary["rows"]:
        key = (row["instructions"], row["mode"])
        correct[key] = correct.get(key, 0) + row["correct"]
    best = max(correct, key=lambda key: correct[key])
    arm = OPERANDS_ARM if BEST_CONFIGURATION.operands else BEST_CONFIGURATION.mode
    assert best == (BEST_CONFIGURATION.instructions, arm), correct
    # and it asks as the study asked: the study's lead-in before each span
    from evald_lab.demo import _ANSWER_LEAD, ENGINE_PROMPTS
    from evald_lab.study.run import INSTRUCTION_LEAD

    assert _ANSWER_LEAD == INSTRUCTION_LEAD
    assert all(prefix == f"{_ANSWER_LEAD}<{name}>" for _, _, prefix, (name, _) in ENGINE_PROMPTS)


@pytest.mark.model
def test_the_engine_section_says_its_configuration_and_judges_every_answer(
    daemon: Daemon,
) -> None:
    import re

    from evald_lab.demo import BEST_CONFIGURATION, ENGINE_PROMPTS, show_local_engine

    buffer = io.StringIO()
    show_local_engine(daemon.target, Console(file=buffer, width=400))
    text = buffer.getvalue()
    assert f"configuration: {BEST_CONFIGURATION.describe()}" in text
    verdicts = re.findall(r"^ +(right|wrong): (.*)$", text, re.M)
    assert len(verdicts) == len(ENGINE_PROMPTS), text
    for (verdict, detail), (_, prompt, _, (name, span)) in zip(
        verdicts, ENGINE_PROMPTS, strict=True
    ):
        assert prompt in text
        rates = text.split(detail, 1)[1].lstrip().split("\n", 1)[0]  # the line after it
        assert rates.startswith("measured"), rates
        if name in ("calc", "strop"):  # the study's tasks
            assert "sets the span up right" in text.split(detail, 1)[1]
        if verdict == "wrong":  # shown honestly: the span the model wrote, and the right one
            assert "never closed" in detail or f"the model wrote <{name}>" in detail
            assert f"<{name}>{span}</{name}>" in detail or "never closed" in detail


def test_the_demo_quotes_the_studys_rates_for_its_model() -> None:
    """Next to each verdict: how often the model sets such a span up right and how many of those
    evald computed right, read from the committed study of the configuration the demo runs."""
    import json
    from pathlib import Path

    from evald_lab.demo import BEST_CONFIGURATION, study_rates
    from evald_lab.study.run import OPERANDS_ARM

    summary = json.loads((Path(__file__).parents[2] / BEST_CONFIGURATION.study).read_text())
    for evaluator, task in (("calc", "arithmetic"), ("strop", "letters")):
        (row,) = [r for r in summary["rows"]
                  if r["task"] == task and r["mode"] == OPERANDS_ARM and r["instructions"]]
        check = summary["checks"]["grammar_eval_correct_when_extracted"][
            f"{task}, {OPERANDS_ARM}, instructions on"]
        text = study_rates(evaluator)
        assert text.startswith(f"measured for {summary['config']['model_title']}")
        assert f"sets the span up right {row['extraction_rate']:.1%} of the time" in text
        assert check["correct"] == check["extracted"]  # what the sentence then says
        assert f"every one of those right ({check['correct']} of {check['extracted']})" in text
    assert "no date questions" in study_rates("date")


def test_the_evaluations_read_in_a_log_at_80_columns(daemon: Daemon) -> None:
    """Printed where no terminal is (80 columns), every span and every printed answer stays on
    one line, whole; on a wide terminal the same rows are a table."""
    narrow = io.StringIO()
    show_evaluations(daemon.target, Console(file=narrow, width=80))
    lines = narrow.getvalue().splitlines()
    assert max(map(len, lines)) <= 80
    served = {info.name for info in daemon.client().list_evaluators()}
    for name, content in EXAMPLES:
        if name in served:
            assert any(f"<{name}>{content}</{name}>" in line for line in lines), content
    if "calc" in served:
        assert any("-> error: division_by_zero" in line for line in lines)
    wide = io.StringIO()
    show_evaluations(daemon.target, Console(file=wide, width=200))
    assert "in daemon µs (warm)" in wide.getvalue()
