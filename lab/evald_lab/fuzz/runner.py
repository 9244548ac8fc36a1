"""One fuzz run, start to end: the daemon, the set-up, the phases, the teardown, the report.

Order: start the daemon (or reach ``--target``); set up the context, the evaluators' grammars and
the tenants' modules (:mod:`.preparation`); start the monitor (:mod:`.monitor`); measure the
noisy neighbour and run what a caller can make the daemon hold (:mod:`.phases`); run the main
loop until the budget is spent (:mod:`.main_loop`); kill -9 the daemon under load and restart
it, then run the full-disk scenario on a second daemon (:mod:`.phases`); stop the daemon (it
must exit 0) and build the report (:mod:`.report_json`).
"""

from __future__ import annotations

import time
from typing import Any

from evald_lab.fuzz.context import FuzzContext
from evald_lab.fuzz.daemon_under_test import reach_daemon
from evald_lab.fuzz.main_loop import run_main_loop
from evald_lab.fuzz.monitor import DaemonMonitor
from evald_lab.fuzz.narration import Narrator
from evald_lab.fuzz.phases import fault_phase, hold_phase, noisy_neighbour_phase
from evald_lab.fuzz.preparation import new_context, prepare
from evald_lab.fuzz.report_json import build_report
from evald_lab.fuzz.settings import FuzzSettings
from evald_lab.fuzz.steps import CLASSES
from evald_lab.fuzz.tally import Recorder

__all__ = ["run_fuzz"]

#: Every class the tally keeps: the main loop's, then the phases' own.
_TALLIED = (*CLASSES, "noisy_neighbour", "fault_kill9", "fault_disk_full")


def run_fuzz(settings: FuzzSettings, *, console: Any = None) -> dict[str, Any]:
    """Runs one fuzz run and returns its report (a JSON-able dict).

    ``console`` (a ``rich`` console) gets a line per phase and the main loop's progress bar.

    Raises:
        ValueError: the settings name a target without its config or tenants.
        RuntimeError: the daemon did not start (the message carries its log).
    """
    started = time.monotonic()
    narrator = Narrator(console, progress=settings.progress)
    recorder = Recorder(_TALLIED)
    narrator.say("starting the daemon and registering modules")
    daemon = reach_daemon(settings)
    ctx: FuzzContext | None = None
    monitor: DaemonMonitor | None = None
    try:
        ctx = new_context(settings, daemon, recorder)
        arsenal = prepare(settings, ctx, daemon.config)
        monitor = DaemonMonitor(
            daemon, recorder, ctx.stop, rss_bound_bytes=settings.rss_bound_bytes
        )
        monitor.start()
        noisy_section = noisy_neighbour_phase(
            ctx, settings, narrator, compile_share=daemon.config.server.compile_queue_per_tenant
        )
        hold_phase(ctx, settings, narrator)
        narrator.say(f"main loop ({settings.budget})")
        main_s = run_main_loop(arsenal, settings, recorder, narrator)
        faults_section = fault_phase(ctx, daemon, monitor, settings, narrator)
    finally:
        if monitor is not None:
            monitor.done.set()
            monitor.join(timeout=10)
        if ctx is not None:
            ctx.close()
        exit_status = daemon.stop(recorder)
        daemon.remove_folder(settings)
    return build_report(
        settings=settings,
        ctx=ctx,
        monitor=monitor,
        elapsed_s=time.monotonic() - started,
        main_s=main_s,
        noisy_section=noisy_section,
        faults_section=faults_section,
        exit_status=exit_status,
    )
