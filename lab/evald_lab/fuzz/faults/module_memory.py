"""Deleted and replaced modules give their memory back: the victim registers a module that fills
16 MiB of guest memory, calls it, and deletes it (or replaces it with new bytes), again and
again; the daemon's resident memory must end where it began, within a margin. Before every
worker's instances of a deleted module went (not only the deleting thread's), each cycle left
its instances behind: 16 cycles of 48 MiB held 848 MiB.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from evald.client import CallError
from evald.contract import pb
from evald.testing import PAGE, arg, guest, manifest_bytes, process_rss_bytes
from evald_lab.fuzz.checks import Violation, outcome_label
from evald_lab.fuzz.context import FuzzContext

__all__ = ["deleted_module_memory"]

_KLASS = "fault_module_memory"
_FILL_BYTES = 16 * 2**20
_CYCLES = 12
#: What the daemon's RSS may have grown by after every cycle: one cycle's worth, not twelve.
_MARGIN_BYTES = 2 * _FILL_BYTES


def _filler(name: str, cycle: int) -> bytes:
    manifest = manifest_bytes(
        name=name, tag=name, semantics_version=f"{name}/1", version=f"1.0.{cycle}"
    )
    return guest("fill", manifest=manifest)


def deleted_module_memory(ctx: FuzzContext, pid: Callable[[], int | None]) -> dict[str, Any]:
    """Register, fill, delete (and register, fill, replace) cycles; returns the report section
    (violations go to the recorder)."""
    daemon_pid = pid()
    if daemon_pid is None:
        return {"skipped": "the daemon's pid is unknown"}
    client = ctx.client(ctx.victim)
    pages = _FILL_BYTES // PAGE
    items = [
        pb.EvaluateRequest(evaluator="", input=arg(pages), id=str(i), deadline_ms=0)
        for i in range(4)
    ]
    time.sleep(0.2)
    before = process_rss_bytes(daemon_pid) or 0
    violations: list[Violation] = []
    outcomes: dict[str, int] = {}
    prefix = f"mem_{ctx.secrets.victim_canary[-6:]}"
    for cycle in range(_CYCLES):
        replacing = cycle % 2 == 1
        name = f"{prefix}_replaced" if replacing else f"{prefix}_{cycle}"
        try:
            client.register(_filler(name, cycle), replace=replacing)
            for item in items:
                item.evaluator = name
            response = client._invoke(
                client._stub.EvaluateBatch, pb.EvaluateBatchRequest(items=items)
            )
            for result in response.results:
                label = outcome_label(result)
                outcomes[label] = outcomes.get(label, 0) + 1
                ctx.recorder.outcome(_KLASS, label, family="fill")
            if not replacing or cycle == _CYCLES - 1:
                client.delete(name)
        except CallError as error:
            code = error.code.value if error.code is not None else "unreachable"
            violations.append(Violation("unexpected", _KLASS, f"cycle {cycle}: {error}"))
            ctx.recorder.outcome(_KLASS, f"call:{code}", family="cycle")
    if f"{prefix}_replaced" in {info.name for info in client.list_evaluators()}:
        client.delete(f"{prefix}_replaced")
    time.sleep(0.2)
    after = process_rss_bytes(daemon_pid) or 0
    grown = after - before
    if grown > _MARGIN_BYTES:
        violations.append(
            Violation(
                "memory",
                _KLASS,
                f"{_CYCLES} register-fill-delete cycles of {_FILL_BYTES >> 20} MiB left the "
                f"daemon {grown >> 20} MiB larger (at most {_MARGIN_BYTES >> 20} MiB)",
            )
        )
    ctx.recorder.add(violations)
    return {
        "cycles": _CYCLES,
        "fill_mib": _FILL_BYTES >> 20,
        "rss_before_mib": before >> 20,
        "rss_after_mib": after >> 20,
        "outcomes": outcomes,
    }
