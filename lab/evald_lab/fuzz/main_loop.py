"""The main loop: ``lanes`` steps in flight until the budget is spent or the daemon is gone.

Each step belongs to one class and draws its inputs from ``random.Random(f"{seed}:{class}:{n}")``
(``n`` counts the class's steps), so what a step sends depends only on the seed and its number,
not on thread timing. A step that raises is a finding (``unexpected``), not the end of the run.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from evald_lab.fuzz.budget import Budget
from evald_lab.fuzz.checks import Violation
from evald_lab.fuzz.narration import Narrator, ProgressSink
from evald_lab.fuzz.preparation import Arsenal
from evald_lab.fuzz.settings import FuzzSettings
from evald_lab.fuzz.steps import CLASSES, STEPS
from evald_lab.fuzz.tally import Recorder

__all__ = ["run_main_loop"]


def run_main_loop(
    arsenal: Arsenal, settings: FuzzSettings, recorder: Recorder, narrator: Narrator
) -> float:
    """Runs the main loop with its progress bar; returns its wall time in seconds."""
    total = settings.seconds if settings.seconds is not None else settings.input_budget
    with narrator.progress(total) as progress:
        return _loop(arsenal, settings, recorder, narrator, progress)


def _timed(recorder: Recorder, klass: str, arsenal: Arsenal, rng: random.Random) -> None:
    started = time.monotonic()
    try:
        STEPS[klass](arsenal, rng)
    finally:
        recorder.step(klass, time.monotonic() - started)


def _loop(
    arsenal: Arsenal,
    settings: FuzzSettings,
    recorder: Recorder,
    narrator: Narrator,
    progress: ProgressSink | None,
) -> float:
    lanes = arsenal.profile.lanes
    budget = Budget(settings, recorder, CLASSES)
    step_numbers = dict.fromkeys(CLASSES, 0)
    inflight: dict[Future[None], str] = {}
    errors: list[BaseException] = []
    with ThreadPoolExecutor(lanes, thread_name_prefix="fuzz-lane") as pool:
        while not arsenal.ctx.stop.is_set():
            classes = budget.active()
            while classes and len(inflight) < lanes:
                klass = budget.next_class(classes)
                number = step_numbers[klass]
                step_numbers[klass] += 1
                rng = random.Random(f"{settings.seed}:{klass}:{number}")
                inflight[pool.submit(_timed, recorder, klass, arsenal, rng)] = klass
            if not inflight:
                break
            finished, _ = wait(list(inflight), timeout=0.5, return_when=FIRST_COMPLETED)
            for future in finished:
                klass = inflight.pop(future)
                error = future.exception()
                if error is not None:
                    errors.append(error)
                    recorder.add([Violation("unexpected", klass, f"the step raised {error!r}")])
            if progress is not None:
                progress(
                    budget.completed(),
                    f"fuzz {budget.done_inputs():,} inputs, {recorder.violation_total} violations",
                )
    if errors:
        narrator.warn(f"{len(errors)} steps raised; first: {errors[0]!r}")
    return budget.elapsed_s()
