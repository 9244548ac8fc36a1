"""The booking study end to end on the real SmolLM2 (three messages, every arm), and its
command's contract: bad arguments exit 2 with a message, saved records are re-scored without a
model."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import pytest

from engine_adapter import literals_in_text
from engine_adapter.cli import main
from evald_lab.study.booking.arms import ARMS, COMPUTED_ARMS
from evald_lab.study.booking.messages import BOOKING_CASES
from evald_lab.study.booking.policy import apply_policy
from evald_lab.study.booking.records import BookingRecord
from evald_lab.study.booking.runner import BookingConfig
from evald_lab.study.booking.scoring import score

#: An offer once summed (42, £6,500 + £4,000), and an under-age customer asking for £14,000.
_CASES = (29, 59)


@pytest.mark.model
@pytest.mark.timeout(900)  # ten requests of up to 96 tokens, on a machine six people share
def test_booking_study_runs_every_arm_and_writes_its_report(
    llama_backend: Any, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    from engine_adapter import InProcessWasmEvaluator, standard_evaluators
    from engine_adapter.local import LocalEngine
    from evald_lab.study.booking.generation import LocalJsonGenerator
    from evald_lab.study.booking.report import resummarize
    from evald_lab.study.booking.runner import plug_policy, run_booking

    out = tmp_path / "booking"
    with InProcessWasmEvaluator() as evaluator:
        engine = LocalEngine(
            llama_backend, smollm2_tokenizer, standard_evaluators(), evaluator=evaluator
        )
        policy = plug_policy(engine)
        assert policy == "wasm"  # the SDK's example policy decides the computed arms
        config = BookingConfig(
            cases=_CASES,
            out_dir=out,
            progress=False,
            warmup=False,
            single_max_new_tokens=96,
            extraction_max_new_tokens=48,
            narration_max_new_tokens=48,
        )
        summary = run_booking(LocalJsonGenerator(engine), config, policy_evaluator=policy)
        assert engine.system_prompt is None, "the engine's system prompt is restored"
        engine.evaluator.close()  # type: ignore[union-attr]
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == len(_CASES) * len(ARMS)
    names = {f.name for f in fields(BookingRecord)}
    records = [json.loads(line) for line in lines]
    assert {(r["case_id"], r["arm"]) for r in records} == {(c, a) for c in _CASES for a in ARMS}
    for record in records:
        assert set(record) == names and record["engine_error"] is None, record
        assert record["backend"] == "llama" and record["model"] == "smollm2"
        assert record["calls"] == (2 if record["arm"] == "two-calls" else 1)
        assert record["wall_ms"] > 0 and record["n_sampled"] > 0
        verdict = record["verdict"]
        if set(record["stop_reasons"]) == {"eos"}:
            # the grammar ended every document: each is valid against its request's schema
            assert verdict["schema_valid"], record["texts"]
        if record["arm"] in COMPUTED_ARMS:
            _check_computed(record)
        else:
            assert record["computed"] == []
    saved = json.loads((out / "summary.json").read_text())
    assert [row["arm"] for row in saved["rows"]] == list(ARMS)
    assert saved["config"]["policy_evaluator"] == policy and not saved["config"]["partial"]
    assert len(saved["comparisons"]) == 2 * 6  # two measures, six pairs of arms
    assert any(t["target"].startswith("computed: decision = policy") for t in saved["targets"])
    table = (out / "table.md").read_text()
    assert table.startswith("| arm | n | schema-valid |") and summary.table_markdown() in table
    assert (out / "booking.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert resummarize(out, plot=False).rows == summary.rows


def _check_computed(record: dict[str, Any]) -> None:
    """The engine computed the decision from what the model wrote, and forced it whole."""
    (computed,) = record["computed"]
    assert computed["field"] == "/decision" and computed["evaluator"] == "booking_policy"
    facts = json.loads(computed["content"])
    decision = apply_policy(facts["age"], facts["components"]).as_json()
    assert computed["error_code"] is None and json.loads(computed["value"]) == decision
    assert record["n_forced"] > 0
    if record["arm"] == "computed+literals":
        held = {float(n) for n in literals_in_text("number", record["message"])}
        written = [facts["age"], *facts["components"]]
        assert {float(n) for n in written if n is not None} <= held
    if record["stop_reasons"] == ["eos"]:
        document = json.loads(record["texts"][0])
        assert facts == {
            "age": document["customer_age"],
            "components": document["price_components"],
        }
        assert document["decision"] == decision
        assert record["verdict"]["follows_facts"] is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arms", "schema-only,shouting"], "unknown arm"),
        (["--cases", "1,999"], "no booking message with id [999]"),
        (["--seeds", "greedy,often"], "--seeds greedy or integers"),
        (["--summarize-only", "--out", "/nonexistent/booking"], "no booking records"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["study", "--problems", "booking", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and message in captured.err


def _record(case_id: int, arm: str, texts: list[str]) -> BookingRecord:
    case = next(c for c in BOOKING_CASES if c.case_id == case_id)
    return BookingRecord(model="smollm2", backend="llama", arm=arm, case_id=case_id,
                         group=case.group, seed=None, message=case.message, expected={},
                         texts=texts, n_sampled=10, n_forced=0, prompt_tokens=5, wall_ms=100.0,
                         prefill_ms=1.0, calls=len(texts), stop_reasons=["eos"] * len(texts),
                         policy_evaluator="python", verdict={})  # fmt: skip


def test_summarize_only_rescores_saved_records_and_keeps_paired_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The records keep the texts, so the table is rebuilt and re-scored from them alone; a
    message that did not run in every arm is left out."""
    right = json.dumps({"customer_age": 42, "price_components": [6500, 4000],
                        "decision": {"action": "offer_alternative", "reason": "over_limit",
                                     "total": 10500},
                        "response_text": "We can offer a smaller consultation."})  # fmt: skip
    wrong = right.replace("offer_alternative", "book_appointment").replace("over_limit", "eligible")
    records = [
        _record(29, "schema-only", [wrong]),
        _record(29, "computed", [right]),
        _record(30, "computed", [right]),  # message 30 ran in one arm only
    ]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
    argv = ["study", "--problems", "booking", "--summarize-only", "--out", str(tmp_path)]
    assert main([*argv, "--no-plot"]) == 0
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "summary.json").read_text())
    rows = {row["arm"]: row for row in saved["rows"]}
    assert rows["computed"]["n"] == 1 and rows["computed"]["decision_correct"]["count"] == 1
    assert rows["schema-only"]["decision_correct"]["count"] == 0
    assert rows["schema-only"]["follows_facts"] == {"count": 0, "of": 1, "rate": 0.0}
    assert "| computed | 1 | 100.0% (1)" in out
    assert score(BOOKING_CASES[28], "computed", [right])["fully_correct"]
