"""``engine-adapter study``: the lab's command reaches the adapter's CLI (entry point), refuses
bad arguments with exit 2 and a message, and re-scores saved records without a model."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from engine_adapter.cli import main
from evald_lab.study.items import arithmetic_items
from evald_lab.study.run import ItemRecord


def test_top_level_help_lists_the_study(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "study" in out and "bench" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["study", "--items", "0"], "at least one item"),
        (["study", "--tasks", "poetry"], "unknown task"),
        (["study", "--modes", "grammar-eval,shouting"], "unknown mode"),
        (["study", "--instructions", "maybe"], "--instructions takes off, on"),
        (["study", "--summarize-only", "--out", "/nonexistent/study"], "no study records"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and message in captured.err


def test_summarize_only_rescores_the_records_without_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The records keep the texts, so the table is rebuilt (and re-scored) from them alone;
    an item that did not run in every condition is left out."""
    items = arithmetic_items(2, 20240601)
    lines = []
    runs = (("no-grammar", "grammar-eval"), ("grammar-eval",))
    for item, conditions in zip(items, runs, strict=True):
        for mode in conditions:
            span = f"<calc>{item.params['expression']}</calc><result>{item.truth}</result>"
            record = ItemRecord(task="arithmetic", item_id=item.item_id, mode=mode,
                                instructions=False, template=item.template, prompt=item.prompt,
                                prefix="", truth=item.truth, text=f"The expression is {span}",
                                answer=None, correct=False, failure="wrong_extraction",
                                failure_detail=None, extraction_ok=False)
            lines.append(json.dumps(asdict(record)))
    (tmp_path / "records.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["study", "--summarize-only", "--out", str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert (
        "| arithmetic | off | grammar-eval | 1 | 100.0% | 100.0% | 100.0% (1) | 20.7-100.0% "
        "| 0 | 0 |" in out
    )
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["config"]["items_completed"] == 1
