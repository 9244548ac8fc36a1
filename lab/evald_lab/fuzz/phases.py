"""The run's phases around the main loop: noisy neighbour, what a caller can make the daemon hold,
and the faults. Each returns its report section (or records into the run's tally).

The noisy neighbour runs only when the attacker's infinite-loop module registered (it is the
attack); the faults only against the run's own daemon (they kill it and fill a disk), and not
after the daemon was lost.
"""

from __future__ import annotations

import random
from typing import Any

from evald_lab.fuzz import faults, noisy, protocol
from evald_lab.fuzz.compile_queue import compile_queue_fairness
from evald_lab.fuzz.context import FuzzContext
from evald_lab.fuzz.control_plane import changes_while_compiling
from evald_lab.fuzz.daemon_under_test import DaemonUnderTest
from evald_lab.fuzz.monitor import DaemonMonitor
from evald_lab.fuzz.narration import Narrator
from evald_lab.fuzz.settings import FuzzSettings

__all__ = ["fault_phase", "hold_phase", "noisy_neighbour_phase"]


def noisy_neighbour_phase(
    ctx: FuzzContext, settings: FuzzSettings, narrator: Narrator, *, compile_share: int
) -> dict[str, Any]:
    """The victim's latency alone and under attack: as many attackers as the daemon has workers
    (or ``--noisy-attackers``), one fewer, and registrations; then the compile queue's share
    per tenant (``compile_share``, the daemon's ``compile_queue_per_tenant``), and a change of
    the victim's while the attacker's module compiles. Empty without the loop module."""
    section: dict[str, Any] = {}
    if not ctx.secrets.attacker_loop:
        return section
    samples = settings.profile.noisy_samples
    narrator.say("noisy neighbour")
    attackers = settings.noisy_attackers or ctx.threads
    section = noisy.measure_noisy_neighbour(ctx, samples=samples, attackers=attackers)
    if attackers > 1:
        # the same attack with fewer concurrent calls than the daemon has workers
        # (what a tenant's max_concurrency below `threads` would enforce)
        section["fewer_attackers"] = noisy.measure_noisy_neighbour(
            ctx, samples=samples, attackers=attackers - 1
        )
    narrator.say("noisy neighbour: registrations")
    section["registration"] = noisy.measure_registration_neighbour(ctx, samples=samples)
    narrator.say("the compile queue's share per tenant")
    section["compile_queue"] = compile_queue_fairness(ctx, share=compile_share)
    narrator.say("a change while another tenant's module compiles")
    section["control_plane"] = changes_while_compiling(ctx)
    return section


def hold_phase(ctx: FuzzContext, settings: FuzzSettings, narrator: Narrator) -> None:
    """Every scenario of what a caller can make the daemon hold, once each (the main loop
    draws them again among the protocol scenarios)."""
    narrator.say("what a caller can make the daemon hold")
    for scenario in protocol.HOLD_SCENARIOS:
        scenario(ctx, random.Random(f"{settings.seed}:hold:{scenario.__name__}"))


def fault_phase(
    ctx: FuzzContext,
    daemon: DaemonUnderTest,
    monitor: DaemonMonitor,
    settings: FuzzSettings,
    narrator: Narrator,
) -> dict[str, Any]:
    """kill -9 under load (the monitor paused meanwhile), then the full disk on a second daemon;
    returns the report's ``faults`` section, with why a fault was skipped."""
    section: dict[str, Any] = {"skipped": {}}
    if settings.faults and daemon.process is not None and not ctx.stop.is_set():
        narrator.say("deleted modules give their memory back")
        section["module_memory"] = faults.deleted_module_memory(ctx, daemon.pid)
        monitor.paused.set()  # the daemon is stopped and started on purpose
        try:
            narrator.say("SIGTERM while registrations compile")
            section["sigterm_compiling"] = faults.sigterm_while_compiling(
                ctx, daemon, grace_s=daemon.config.server.shutdown_grace_s
            )
            narrator.say("the state folder checked at load")
            section["state_folder"] = faults.state_folder_at_load(ctx, daemon)
        finally:
            monitor.paused.clear()
        narrator.say("kill -9 under load")
        monitor.paused.set()
        try:
            section["kill9"] = faults.kill_under_load(
                ctx, kill=daemon.kill, restart=daemon.restart, pid=daemon.pid
            )
        finally:
            monitor.paused.clear()
        assert daemon.root is not None
        narrator.say("full disk")
        disk, violations = faults.disk_full(daemon.root / "disk", margin_ms=settings.margin_ms)
        section["disk_full"] = disk
        ctx.recorder.add(violations)
        for case in disk["cases"]:
            ctx.recorder.outcome("fault_disk_full", str(case["outcome"]), family=str(case["case"]))
    elif not settings.faults:
        section["skipped"] = {"kill9": "--no-faults", "disk_full": "--no-faults"}
    else:
        section["skipped"] = {
            "kill9": "not our daemon (--target)",
            "disk_full": "not our daemon (--target)",
        }
    return section
