"""``engine-adapter bench vs-tools`` end to end on a real SGLang CPU server, on its smallest
setting (one answer per path, concurrency 1, quiet): the report's files and fields. Its numbers
are measured, not tested; what is checked is what holds whatever the machine's speed — one
request per span answer, two per tool answer, the forced value stated exactly, usage read from
the server.

Runs in ``make sglang-test`` (the ``sglang_server`` marker); needs ``.venv-sglang`` (or
``EVALD_SGLANG_PYTHON``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from engine_adapter.testing.sglang import sglang_python

pytestmark = pytest.mark.sglang_server


@pytest.mark.timeout(1500)  # starts its own daemon and SGLang server (minutes on a busy machine)
def test_the_benchmark_runs_end_to_end_and_writes_its_report(tmp_path: Path) -> None:
    if sglang_python() is None:
        pytest.skip("the SGLang venv is absent (make sglang-venv, or EVALD_SGLANG_PYTHON)")
    from evald_lab.bench import vs_tools

    parser = argparse.ArgumentParser()
    vs_tools.add_arguments(parser)
    args = parser.parse_args(
        [
            "--servers",
            "sglang",
            "--concurrency",
            "1",
            "--rounds",
            "1",
            "--answers",
            "1",
            "--warmup",
            "1",
            "--hogs",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    assert vs_tools.main(args) == 0
    document = json.loads((tmp_path / "vs_tools.json").read_text())
    assert (tmp_path / "vs_tools.png").stat().st_size > 1000
    assert document["settings"]["tool_choice_first_turn"] == "required"
    run = document["runs"]["sglang/quiet"]
    assert run["tool_runner"] in ("evald", "inprocess")
    assert set(run["tool_timing"]["p50_us"]) == {"evald", "inprocess"}
    span, tool = run["cells"]["span"]["1"], run["cells"]["tool"]["1"]
    assert span["answers"] == tool["answers"] == 1
    assert span["requests_per_answer"] == 1 and tool["requests_per_answer"] == 2
    assert span["stated"]["exact"] == 1  # the forced value, by construction
    assert sum(tool["stated"].values()) == 1
    for cell in (span, tool):
        assert cell["e2e"]["p50_ms"] > 0 and cell["answers_per_s"] > 0
        assert cell["prompt_tokens_per_answer"] > 0 and cell["completion_tokens_per_answer"] > 0
        assert cell["cached_tokens_per_answer"] is not None  # --enable-cache-report
    assert span["value_in_stream"]["n"] == 1
    assert tool["between_turns"]["n"] == 1 and tool["value_at_client"]["n"] == 1
    # The tool path's second turn re-sends the first turn's prompt: more prompt tokens.
    assert tool["prompt_tokens_per_answer"] > span["prompt_tokens_per_answer"]
    ratios = run["ratios"]
    assert ratios["time_per_answer_span_over_tool"] > 0
    assert ratios["at_concurrency"] == ratios["answers_per_s_at_concurrency"] == 1
    kinds = {(a["path"], a["stated"]) for a in run["answers"]}
    assert ("span", "exact") in kinds and len(run["answers"]) == 2
