"""One line of the booking study's ``records.jsonl``: what ran, what it generated, and the
verdict; read back and re-scored without the model."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evald_lab.study.booking.messages import BOOKING_CASES
from evald_lab.study.booking.scoring import score

__all__ = ["BookingRecord", "load_records", "rescore"]


@dataclass
class BookingRecord:
    """One (seed, message, arm): one line of ``records.jsonl``. The texts are kept, so the
    scoring (every field after ``computed``) can be re-run without the model."""

    model: str
    backend: str
    arm: str
    case_id: int
    group: str
    seed: int | None
    message: str
    expected: dict[str, Any]
    texts: list[str]
    """The generated JSON: one text, or the extraction's and the narration's (``two-calls``)."""
    n_sampled: int
    n_forced: int
    prompt_tokens: int
    wall_ms: float
    prefill_ms: float
    calls: int
    stop_reasons: list[str]
    policy_evaluator: str
    """Who decided in the computed arms: ``wasm`` (the engine's ``booking_policy`` module) or
    ``python`` (:class:`~.policy.PolicyEvaluator`); ``code`` in ``two-calls``; ``model``."""
    computed: list[dict[str, Any]] = field(default_factory=list)
    engine_error: str | None = None
    verdict: dict[str, Any] = field(default_factory=dict)
    """:func:`~.scoring.score`'s fields."""


def load_records(path: Path) -> list[BookingRecord]:
    """The records of a ``records.jsonl`` (a line cut short by an interruption is skipped)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(BookingRecord(**json.loads(line)))
        except (ValueError, TypeError):
            continue
    return out


def rescore(records: Sequence[BookingRecord]) -> list[BookingRecord]:
    """The records scored again from their texts (the scoring rules may have changed)."""
    cases = {case.case_id: case for case in BOOKING_CASES}
    out = []
    for record in records:
        case = cases.get(record.case_id)
        if case is None or case.message != record.message:
            continue
        record.verdict = score(case, record.arm, record.texts)
        out.append(record)
    return out
