"""The stall benchmarks' summary (``evald_lab.bench._stall``): the ratios to the fast arm, the
targets and the report, from gaps given here (the real-server runs are checked beside the
servers: test_sglang_server.py, test_vllm_server.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from evald_lab.bench._stall import (
    LONGEST_RATIO_TARGET,
    MEDIAN_RATIO_TARGET,
    summarize,
    write_report,
)

DEADLINE_MS = 3000.0


def test_ratios_are_taken_against_the_fast_arm() -> None:
    gaps = {"fast": [0.10, 0.10, 0.20, 0.40], "spinning": [0.10, 0.12, 0.20, 0.50]}
    longest = {"fast": [0.20, 0.40, 0.30], "spinning": [0.50, 0.30, 0.45]}
    arms = summarize(gaps, longest, DEADLINE_MS)
    assert "median_ratio" not in arms["fast"]
    spinning = arms["spinning"]
    assert spinning["median_gap_ms"] == pytest.approx(160.0)
    assert spinning["median_ratio"] == pytest.approx(160.0 / 150.0)
    assert spinning["longest_ratio"] == pytest.approx(500.0 / 400.0)
    # A typical round's longest: the median over rounds (450 ms against 300 ms).
    assert spinning["median_round_longest_ms"] == pytest.approx(450.0)
    assert spinning["round_longest_ratio"] == pytest.approx(1.5)
    assert spinning["under_deadline"] is True
    assert spinning["targets_met"] is False  # the median is 1.067 > 1.02


@pytest.mark.parametrize(
    ("late", "met"),
    [
        ([0.100, 0.100, 0.100, 0.40 * LONGEST_RATIO_TARGET - 0.001], True),
        ([0.100, 0.100, 0.100, 0.40 * LONGEST_RATIO_TARGET + 0.01], False),  # the longest
        ([0.100 * MEDIAN_RATIO_TARGET + 0.005] * 3 + [0.40], False),  # the median
        ([0.100, 0.100, 0.100, 0.40, 3.0], False),  # one span deadline
    ],
)
def test_targets(late: list[float], met: bool) -> None:
    gaps = {"fast": [0.100, 0.100, 0.100, 0.40], "slow": late}
    arms = summarize(gaps, {"fast": [0.40], "slow": [max(late)]}, DEADLINE_MS)
    assert arms["slow"]["targets_met"] is met


def test_the_report_keeps_the_summary_and_plots_it(tmp_path: Path) -> None:
    gaps = {"fast": [0.1, 0.2], "stopped": [0.1, 0.3]}
    arms = summarize(gaps, {"fast": [0.2], "stopped": [0.3]}, DEADLINE_MS)
    result = {"span_deadline_ms": DEADLINE_MS, "arms": arms, "gaps_ms": {"fast": [100.0, 200.0],
              "stopped": [100.0, 300.0]}}  # fmt: skip
    path = tmp_path / "stall.json"
    write_report({"normal/jump/quiet": result}, path)
    saved = json.loads(path.read_text())
    assert "gaps_ms" not in saved["normal/jump/quiet"]
    assert saved["normal/jump/quiet"]["arms"]["stopped"]["longest_ratio"] == pytest.approx(1.5)
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rounds_count_the_wait_for_the_first_token_and_stop_evald_for_its_arm() -> None:
    """``run_rounds`` with plain callables in place of a server: the gaps start with the wait
    from sending to the first chunk, each round's longest is kept, and the process given as
    evald is stopped (SIGSTOP) exactly through the ``stopped`` arm's requests."""
    import subprocess
    import time

    from evald_lab.bench._stall import run_rounds

    stand_in = subprocess.Popen(["sleep", "60"])  # stands in for evald: a process to stop

    def state() -> str:
        return Path(f"/proc/{stand_in.pid}/stat").read_text().split(") ", 1)[1][0]

    def stopped_soon() -> str:
        """The state once a SIGSTOP sent has taken effect (the stopped process applies it
        when it next runs: a loaded machine may take a while)."""
        give_up = time.monotonic() + 30
        while state() != "T" and time.monotonic() < give_up:
            time.sleep(0.01)
        return state()

    seen_states: dict[str, str] = {}

    def evaluate(name: str) -> Callable[[], str]:
        def call() -> str:
            seen_states[name] = stopped_soon() if name == "stopped" else state()
            return f"text of {name}"

        return call

    def stream(prompt: str) -> list[float]:
        now = time.monotonic()  # chunks 1 s, 1.5 s and 3.5 s after it was sent
        return [now + 1.0, now + 1.5, now + 3.5]

    try:
        seen = run_rounds(
            {name: evaluate(name) for name in ("fast", "stopped")},
            stream,
            ["a prompt"],
            rounds=2,
            plain=2,
            evaluated=1,
            plain_after_s=0.0,
            daemon_pid=stand_in.pid,
        )
        after = state()
    finally:
        stand_in.kill()
        stand_in.wait()
    assert seen_states["stopped"] == "T"
    assert seen_states["fast"] != "T" and after != "T"
    assert list(seen.gaps) == ["fast", "stopped"]
    for name in seen.gaps:
        assert len(seen.gaps[name]) == 2 * 2 * 3  # rounds, plain, first token + 2 gaps
        assert all(1.0 <= w < 1.5 for w in seen.first_token[name]), seen.first_token[name]
        assert seen.longest[name] == [pytest.approx(2.0)] * 2
        assert seen.texts[name] == [f"text of {name}"] * 2
        # The plain requests ended 3.5 s after they were sent, long after the evaluated
        # ones came back: none lay inside them.
        assert seen.overlapped[name] == [False] * 4
    arms = summarize(seen.gaps, seen.longest, DEADLINE_MS, seen.first_token)
    assert 1000.0 <= arms["fast"]["first_token_max_ms"] < 1500.0


def test_a_plain_request_that_ends_before_the_evaluated_ones_come_back_overlapped() -> None:
    """A plain request counts as overlapped when its last chunk came before the round's first
    evaluated request came back (the spans were still pending all its life)."""
    import time

    from evald_lab.bench._stall import result_of, run_rounds

    def evaluate() -> str:
        time.sleep(0.3)
        return "evaluated"

    def quick(prompt: str) -> list[float]:
        now = time.monotonic()
        return [now + 0.01, now + 0.02]

    seen = run_rounds(
        {"fast": evaluate, "spinning": evaluate}, quick, ["p"], rounds=1, plain=2, evaluated=2,
        plain_after_s=0.0,
    )  # fmt: skip
    assert seen.overlapped == {"fast": [True, True], "spinning": [True, True]}
    assert result_of(seen, DEADLINE_MS)["overlapped_share"] == {"fast": 1.0, "spinning": 1.0}
