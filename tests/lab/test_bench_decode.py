"""``engine-adapter bench decode`` on its tiny profile: the real model, the real daemon (started
by the benchmark), every part, and a well-formed ``decode.json`` (never a timing assertion)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_adapter.cli import main
from evald_lab.bench.decode import MODES, PROFILES

pytestmark = pytest.mark.model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def decode(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the llama extra)")
    out = tmp_path_factory.mktemp("bench")
    assert main(["bench", "decode", "--profile", "tiny", "--out", str(out), "--quiet"]) == 0
    return out, json.loads((out / "decode.json").read_text())


def test_decode_modes_force_the_same_tokens(decode: tuple[Path, dict]) -> None:
    out, document = decode
    assert document["benchmark"] == "decode"
    modes = {m["mode"]: m for m in document["decode"]["modes"]}
    assert tuple(modes) == MODES
    profile = PROFILES["tiny"]
    for mode in modes.values():
        assert mode["generations"] == profile.prompts_per_task * 2 * profile.repeats
        assert mode["tokens_per_s"] > 0
        assert mode["spans"] >= 1
        assert mode["span_errors"] == {}, mode  # every evaluator answered every span
        assert mode["forwards_per_injected_result"] == 1.0  # the local engine's one forward
        # the evaluators agree, so the forced results (and all later tokens) are identical
        assert mode["same_tokens_as_none"], mode
    assert document["decode"]["evald_vs_python_tokens_per_s"] > 0
    assert (out / "decode.png").read_bytes().startswith(PNG_MAGIC)


def test_toolcall_and_stall_are_measured(decode: tuple[Path, dict]) -> None:
    document = decode[1]
    tool = document["toolcall"]
    assert tool["spans"] >= 1
    assert tool["in_loop_vs_toolcall"] == pytest.approx(
        tool["in_loop_span_ms"] / tool["toolcall_span_ms"], rel=1e-3
    )
    stall = document["stall"]
    assert [p["policy"] for p in stall["policies"]] == ["skip", "wait"]
    for policy in stall["policies"]:
        for run in ("baseline", "slow"):
            assert policy[run]["other_step_ms"] > 0
            assert policy[run]["steps"] == PROFILES["tiny"].stall_steps
            assert policy[run]["sequence_0_spans"] >= 1  # sequence 0 did write a span
        assert policy["stall_ratio"] == pytest.approx(
            policy["slow"]["other_step_ms"] / policy["baseline"]["other_step_ms"], rel=1e-2
        )
    # only the slow run's span reaches its deadline; the wait policy stands blocked on it
    wait = next(p for p in stall["policies"] if p["policy"] == "wait")
    assert wait["slow"]["blocked_ms_max"] >= stall["slow_deadline_ms"] * 0.5
    assert document["gpu_variant"] == "deploy/gpu-check.sh"


def test_unknown_parts_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "decode", "--parts", "decode,warp"]) == 2
    assert "unknown --parts" in capsys.readouterr().err
