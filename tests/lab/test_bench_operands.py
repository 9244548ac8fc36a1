"""``engine-adapter bench operands`` on its tiny profile: the real tokenizer and XGrammar, both
grammars of each question measured, and a well-formed ``operands.json`` (never a timing
assertion)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_adapter.cli import main
from evald_lab.bench.operands import PROFILES

pytest.importorskip("xgrammar")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_operands_bench_measures_both_grammars_side_by_side(tmp_path: Path) -> None:
    assert main(["bench", "operands", "--profile", "tiny", "--out", str(tmp_path), "--quiet"]) == 0
    document = json.loads((tmp_path / "operands.json").read_text())
    profile = PROFILES["tiny"]
    assert document["benchmark"] == "operands"
    assert document["questions"] == 2 * profile.questions_per_task
    summary = document["summary"]
    runs = document["questions"] * profile.repeats
    for key in ("narrow_ms", "compile_plain_ms", "compile_operands_ms"):
        assert summary[key]["n"] == runs and summary[key]["median"] > 0
    # the same correct span walked through both grammars: as many fills in each
    assert summary["fill_plain_us"]["n"] == summary["fill_operands_us"]["n"] > runs
    assert document["ratios"]["compile_operands_vs_plain"] > 0
    assert [g["numbers_in_text"] for g in document["growth"]] == list(profile.literal_counts)
    assert document["machine"]["load_average_at_start"]
    assert (tmp_path / "operands.png").read_bytes().startswith(PNG_MAGIC)
