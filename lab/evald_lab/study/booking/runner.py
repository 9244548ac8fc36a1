"""Runs the booking study: every message through every arm, paired, one record per (seed,
message, arm), written as the study goes.

Fairness, as the original study's runner: the same messages, policy text and token budgets in
every arm; greedy decoding by default (``seeds``: sampled runs, each seed shared by every arm);
one discarded warm-up request per arm before anything is measured (the first request of a
schema compiles its grammar); the arms' order rotates from one message to the next, so no arm
always runs on the warmer cache.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from evald_lab.study.booking.arms import (
    ARMS,
    COMPUTED_ARMS,
    COMPUTED_LITERALS,
    EXTRACTION_PROMPT,
    NARRATION_PROMPT,
    SINGLE_CALL_PROMPT,
    TWO_CALLS,
    arm_schema,
    extraction_schema,
    narration_request,
    narration_schema,
)
from evald_lab.study.booking.generation import JsonGenerator, JsonReply, JsonRequest
from evald_lab.study.booking.messages import BOOKING_CASES, BookingCase
from evald_lab.study.booking.policy import (
    POLICY_NAME,
    POLICY_SPEC,
    PolicyEvaluator,
    WasmPolicy,
    apply_policy,
)
from evald_lab.study.booking.records import BookingRecord, load_records, rescore
from evald_lab.study.booking.report import summarize, write_report
from evald_lab.study.booking.scoring import score

__all__ = [
    "BookingConfig",
    "BookingRecord",
    "load_records",
    "plug_policy",
    "rescore",
    "run_booking",
    "run_one",
]

#: Rewrite the summary after this many records (an interrupted run leaves a table).
_PARTIAL_EVERY = 20


@dataclass(frozen=True)
class BookingConfig:
    """What to run and where to write it.

    Raises:
        ValueError: an unknown arm or case, no arms, or a budget below one token.
    """

    model: str = "smollm2"
    arms: tuple[str, ...] = ARMS
    cases: tuple[int, ...] = ()
    """Case ids to run (empty: all of them)."""
    seeds: tuple[int | None, ...] = (None,)
    """``None``: greedy; an integer: sampled at ``temperature`` with that seed."""
    temperature: float = 0.7
    out_dir: Path = Path("reports/study/booking")
    single_max_new_tokens: int = 200
    extraction_max_new_tokens: int = 64
    narration_max_new_tokens: int = 128
    warmup: bool = True
    plot: bool = True
    progress: bool = True
    resume: bool = False

    def __post_init__(self) -> None:
        bad = [arm for arm in self.arms if arm not in ARMS]
        if bad or not self.arms:
            raise ValueError(f"unknown arm(s) {bad}; choose from {', '.join(ARMS)}")
        known = {case.case_id for case in BOOKING_CASES}
        missing = [case for case in self.cases if case not in known]
        if missing:
            raise ValueError(f"no booking message with id {missing}; ids are 1-{max(known)}")
        budgets = (
            self.single_max_new_tokens,
            self.extraction_max_new_tokens,
            self.narration_max_new_tokens,
        )
        if min(budgets) < 1:
            raise ValueError("token budgets must be positive")
        if not self.seeds:
            raise ValueError("seeds: give at least one (greedy is the default)")

    def selected(self) -> list[BookingCase]:
        wanted = set(self.cases)
        return [case for case in BOOKING_CASES if not wanted or case.case_id in wanted]


def plug_policy(engine: Any, kind: str = "wasm") -> str:
    """Makes ``booking_policy`` available to the engine and says which one it is: ``wasm``
    (default) when its evaluators already hold it, or else the SDK's example policy is put in
    front of the engine's evaluator (:class:`WasmPolicy`); ``python``: the policy's manifest is
    added and :class:`PolicyEvaluator` answers it in this process (the code of the two-calls
    arm, as an evaluator)."""
    if any(spec.name == POLICY_NAME for spec in engine.evaluators):
        return "wasm"
    if kind == "wasm":
        policy = WasmPolicy(engine.evaluator)
        engine.evaluators = (*engine.evaluators, policy.spec)
        engine.evaluator = policy
        return "wasm"
    engine.evaluators = (*engine.evaluators, POLICY_SPEC)
    engine.evaluator = PolicyEvaluator(engine.evaluator)
    return "python"


def _expected(case: BookingCase) -> dict[str, Any]:
    return {
        "age": case.age,
        "components": list(case.components),
        "total": case.total,
        "action": case.action,
        "reason": case.reason,
        "when": case.when,
    }


def _single_request(config: BookingConfig, case: BookingCase, arm: str) -> JsonRequest:
    return JsonRequest(
        system=SINGLE_CALL_PROMPT,
        prompt=case.message,
        schema=arm_schema(arm),
        literals_from=case.message if arm == COMPUTED_LITERALS else None,
        max_new_tokens=config.single_max_new_tokens,
    )


def _two_calls(
    generator: JsonGenerator, config: BookingConfig, case: BookingCase, sampling: dict[str, Any]
) -> list[JsonReply]:
    """Extract, apply the policy in Python, narrate given the decision."""
    first = generator.generate(
        JsonRequest(
            system=EXTRACTION_PROMPT,
            prompt=case.message,
            schema=extraction_schema(),
            max_new_tokens=config.extraction_max_new_tokens,
            **sampling,
        )
    )
    try:
        facts = json.loads(first.text)
    except json.JSONDecodeError:
        facts = {}
    facts = facts if isinstance(facts, dict) else {}
    age = facts.get("customer_age")
    components = facts.get("price_components")
    decision = apply_policy(
        age if isinstance(age, int | float) and not isinstance(age, bool) else None,
        [c for c in components if isinstance(c, int | float)]
        if isinstance(components, list)
        else None,
    )
    second = generator.generate(
        JsonRequest(
            system=NARRATION_PROMPT,
            prompt=narration_request(case.message, decision),
            schema=narration_schema(),
            max_new_tokens=config.narration_max_new_tokens,
            **sampling,
        )
    )
    return [first, second]


def run_one(
    generator: JsonGenerator,
    config: BookingConfig,
    case: BookingCase,
    arm: str,
    seed: int | None,
    policy_evaluator: str,
) -> BookingRecord:
    """One (seed, message, arm), generated and scored. An engine error (a refused schema, a
    prompt over the context) is recorded, scored as an invalid answer, and the study goes on."""
    sampling: dict[str, Any] = (
        {} if seed is None else {"temperature": config.temperature, "seed": seed}
    )
    replies: list[JsonReply] = []
    error = None
    try:
        if arm == TWO_CALLS:
            replies = _two_calls(generator, config, case, sampling)
        else:
            request = _single_request(config, case, arm)
            replies = [generator.generate(JsonRequest(**{**asdict(request), **sampling}))]
    except Exception as exc:  # the engine refused or failed this request: record and go on
        error = f"{type(exc).__name__}: {exc}"
    texts = [reply.text for reply in replies] or [""]
    who = policy_evaluator if arm in COMPUTED_ARMS else "code" if arm == TWO_CALLS else "model"
    return BookingRecord(
        model=config.model,
        backend=generator.backend,
        arm=arm,
        case_id=case.case_id,
        group=case.group,
        seed=seed,
        message=case.message,
        expected=_expected(case),
        texts=texts,
        n_sampled=sum(r.n_sampled for r in replies),
        n_forced=sum(r.n_forced for r in replies),
        prompt_tokens=sum(r.prompt_tokens for r in replies),
        wall_ms=round(sum(r.wall_ms for r in replies), 2),
        prefill_ms=round(sum(r.prefill_ms for r in replies), 2),
        calls=len(replies),
        stop_reasons=[r.stop_reason for r in replies],
        policy_evaluator=who,
        computed=[entry for r in replies for entry in r.computed],
        engine_error=error,
        verdict=score(case, arm, texts),
    )


def _plan(config: BookingConfig) -> list[tuple[int | None, BookingCase, str]]:
    """Every (seed, message, arm) in run order: the arms rotate from one message to the next."""
    plan = []
    for seed in config.seeds:
        for index, case in enumerate(config.selected()):
            turn = index % len(config.arms)
            for arm in (*config.arms[turn:], *config.arms[:turn]):
                plan.append((seed, case, arm))
    return plan


def run_booking(
    generator: JsonGenerator,
    config: BookingConfig,
    *,
    policy_evaluator: str,
    meta: dict[str, Any] | None = None,
    on_record: Callable[[BookingRecord], None] | None = None,
) -> Any:
    """Runs the plan, writes ``records.jsonl``, ``summary.json``, ``table.md`` and
    ``booking.png`` under ``config.out_dir``, and returns the :class:`~.report.BookingSummary`.

    Parameters:
        generator: the generation step (:class:`~.generation.LocalJsonGenerator` on a local
            engine whose evaluators include ``booking_policy``: see :func:`plug_policy`).
        policy_evaluator: what :func:`plug_policy` said (kept in the records and summary).
        meta: what the summary's ``config`` adds (the load, the threads…).
    """
    config.out_dir.mkdir(parents=True, exist_ok=True)
    path = config.out_dir / "records.jsonl"
    done = _resumable(path, config) if config.resume else {}
    plan = _plan(config)
    started = time.perf_counter()

    def settings(partial: bool) -> dict[str, Any]:
        return {
            **_config_json(config),
            **(meta or {}),
            "backend": generator.backend,
            "policy_evaluator": policy_evaluator,
            "wall_s": round(time.perf_counter() - started, 1),
            "load_average_at_end": _load_average(),
            "partial": partial,
        }

    if config.warmup and len(done) < len(plan):
        first = config.selected()[0]
        for arm in config.arms:
            run_one(generator, config, first, arm, config.seeds[0], policy_evaluator)
    records: list[BookingRecord] = []
    progress = _Progress(config.progress, len(plan))
    try:
        with path.open("w", encoding="utf-8") as sink:
            for seed, case, arm in plan:
                record = done.get((seed, case.case_id, arm))
                if record is None:
                    record = run_one(generator, config, case, arm, seed, policy_evaluator)
                    if on_record is not None:
                        on_record(record)
                records.append(record)
                sink.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
                sink.flush()
                progress.advance()
                if len(records) % _PARTIAL_EVERY == 0:
                    write_report(summarize(records, settings(True)), config.out_dir, plot=False)
    finally:
        progress.stop()
    summary = summarize(records, settings(False))
    write_report(summary, config.out_dir, plot=config.plot)
    return summary


def _load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _config_json(config: BookingConfig) -> dict[str, Any]:
    out = asdict(config)
    out["out_dir"] = str(config.out_dir)
    out["cases"] = [case.case_id for case in config.selected()]
    for key in ("plot", "progress", "resume"):
        out.pop(key)
    return out


def _resumable(
    path: Path, config: BookingConfig
) -> dict[tuple[int | None, int, str], BookingRecord]:
    """Records of an earlier run of the same model on the same messages."""
    if not path.exists():
        return {}
    messages = {case.case_id: case.message for case in config.selected()}
    return {
        (r.seed, r.case_id, r.arm): r
        for r in load_records(path)
        if r.model == config.model
        and r.arm in config.arms
        and messages.get(r.case_id) == r.message
        and r.engine_error is None
    }


class _Progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._bar: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        self._bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=Console(file=sys.stderr),
        )
        self._bar.start()
        self._task = self._bar.add_task("booking study", total=total)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
