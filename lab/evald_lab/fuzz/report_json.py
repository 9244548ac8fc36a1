"""The run's JSON report (``evald_fuzz_report: 1``), assembled from its tally and sections.

:mod:`.report` writes it out, with a summary and a plot; this module decides what it holds:
the run's settings and machine, the daemon's limits, totals (crashes, hangs, limit escapes,
tenant leaks, stalls), latency and deadline overruns, the daemon's RSS, the per-class tallies,
the noisy-neighbour and fault sections, the hardening list and every violation sample.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict
from importlib.metadata import version
from typing import Any

from evald_lab.fuzz.checks import LIMIT_ESCAPES
from evald_lab.fuzz.context import FuzzContext
from evald_lab.fuzz.hardening import HARDENING
from evald_lab.fuzz.monitor import DaemonMonitor
from evald_lab.fuzz.settings import FuzzSettings
from evald_lab.fuzz.steps import CLASSES
from evald_lab.fuzz.tally import ClassStats, Recorder

__all__ = ["build_report"]


def build_report(
    *,
    settings: FuzzSettings,
    ctx: FuzzContext,
    monitor: DaemonMonitor,
    elapsed_s: float,
    main_s: float,
    noisy_section: dict[str, Any],
    faults_section: dict[str, Any],
    exit_status: int | None,
) -> dict[str, Any]:
    """The report of a run that got through its set-up (a JSON-able dict)."""
    recorder = ctx.recorder
    stats = list(recorder.classes.values())
    main_inputs = sum(recorder.classes[c].inputs for c in CLASSES)
    return {
        "evald_fuzz_report": 1,
        "profile": settings.profile.name,
        "seed": settings.seed,
        "budget": settings.budget,
        "elapsed_s": round(elapsed_s, 1),
        "main_loop_s": round(main_s, 1),
        "inputs_per_s": round(main_inputs / main_s, 1) if main_s else 0.0,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "wasmtime": version("wasmtime"),
            "grpcio": version("grpcio"),
        },
        "daemon": {
            "kind": "started by evald fuzz"
            if settings.target is None
            else f"target {settings.target}",
            "threads": ctx.threads,
            "limits": _limits(ctx),
            "exit_status_on_sigterm": exit_status,
            "margin_ms": settings.margin_ms,
        },
        "profile_settings": asdict(settings.profile),
        "totals": _totals(recorder, stats),
        "latency": _latency(recorder, stats),
        "rss": {
            "peak_mib": round(monitor.peak_rss / 2**20, 1),
            "bound_mib": settings.rss_bound_bytes / 2**20,
            "samples": monitor.samples,
            "health_checks": monitor.health_checks,
        },
        "classes": {
            name: s.to_json() for name, s in recorder.classes.items() if s.inputs or s.violations
        },
        "noisy_neighbour": noisy_section,
        "faults": faults_section,
        "hardening": list(HARDENING),
        "violations": [v.to_json() for v in recorder.violations],
    }


def _limits(ctx: FuzzContext) -> dict[str, dict[str, float]]:
    """The two tenants' limits, under their roles (``victim``, ``attacker``)."""
    limits = {}
    for name in (ctx.victim, ctx.attacker):
        bounds = ctx.bounds[name]
        limits["victim" if name == ctx.victim else "attacker"] = {
            "fuel": bounds.fuel,
            "deadline_ms": bounds.deadline_ms,
            "memory_mib": bounds.memory_bytes / 2**20,
            "input_kib": bounds.input_bytes / 1024,
            "output_kib": bounds.output_bytes / 1024,
        }
    return limits


def _totals(recorder: Recorder, stats: list[ClassStats]) -> dict[str, Any]:
    counts = recorder.violation_counts
    return {
        "inputs": sum(s.inputs for s in stats),
        "typed_errors": sum(s.typed_errors for s in stats),
        "crashes": counts.get("crash", 0),
        "hangs": counts.get("hang", 0),
        "limit_escapes": sum(n for kind, n in counts.items() if kind in LIMIT_ESCAPES),
        "tenant_leaks": counts.get("tenant_leak", 0),
        "call_leaks": counts.get("call_leak", 0),
        "violations": sum(counts.values()),
        "by_kind": dict(counts),
        "stalls": sum(s.stalls for s in stats),
        "max_stall_ms": round(max((s.max_stall_ms for s in stats), default=0.0), 1),
    }


def _latency(recorder: Recorder, stats: list[ClassStats]) -> dict[str, Any]:
    return {
        "max_eval_ms": max((s.max_eval_us for s in stats), default=0) / 1000,
        "deadline_overruns": recorder.overruns,
        "worst_overrun_ms": round(recorder.worst_overrun_us / 1000, 2),
        "worst_overrun_deadline_ms": recorder.worst_overrun_deadline_ms,
        "worst_overrun_class": recorder.worst_overrun_class,
        "max_call_ms": round(max((s.max_call_ms for s in stats), default=0.0), 1),
    }
