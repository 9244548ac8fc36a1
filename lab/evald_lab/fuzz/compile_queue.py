"""The compile queue is shared fairly: the attacker sends more heavy registrations at once than
its share of the queue, and the victim registers a small module meanwhile.

The attacker's registrations past ``compile_queue_per_tenant`` must be refused at once with
``unavailable`` (typed), the victim's must register, and it must compile before the attacker's
second one: the queue serves tenants round-robin. Before, the queue was first come, first
served with no share, and eight slow registrations of one tenant kept another's out for 45 s.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from evald.client import CallError
from evald.contract import append_custom_section
from evald.testing import guest, manifest_bytes
from evald_lab.fuzz.checks import Violation
from evald_lab.fuzz.context import FuzzContext
from evald_lab.fuzz.noisy import heavy_module

__all__ = ["compile_queue_fairness"]

_KLASS = "compile_queue"
#: What the daemon answers a registration past its tenant's share of the compile queue.
_SHARE_FULL = "registrations waiting or compiling"


class _Registration(threading.Thread):
    def __init__(self, ctx: FuzzContext, tenant: str, wasm: bytes, label: str) -> None:
        super().__init__(name=f"fuzz-queue-{label}", daemon=True)
        self.ctx, self.tenant, self.wasm, self.label = ctx, tenant, wasm, label
        self.outcome = ""
        self.message = ""
        self.took_s = 0.0
        self.finished_at = 0.0

    def run(self) -> None:
        started = time.monotonic()
        try:
            self.ctx.client(self.tenant).register(self.wasm, replace=True)
            self.outcome = "registered"
        except CallError as error:
            self.outcome = error.code.value if error.code is not None else "unreachable"
            self.message = error.message
        self.finished_at = time.monotonic()
        self.took_s = self.finished_at - started
        self.ctx.recorder.outcome(_KLASS, self.outcome, family=self.tenant)


def compile_queue_fairness(ctx: FuzzContext, *, share: int) -> dict[str, Any]:
    """``share + 2`` heavy attacker registrations at once, then one victim registration;
    returns the report section (violations go to the recorder)."""
    base = heavy_module(f"queue_{ctx.secrets.attacker_canary[-6:]}")
    attackers = [
        _Registration(
            ctx, ctx.attacker, append_custom_section(base, "pad", bytes([index])), f"a{index}"
        )
        for index in range(share + 2)
    ]
    for registration in attackers:
        registration.start()
        time.sleep(0.1)  # in order: the first compiles, the next waits, the rest are refused
    name = f"queue_v_{ctx.secrets.victim_canary[-6:]}"
    victim = _Registration(
        ctx,
        ctx.victim,
        guest("echo", manifest=manifest_bytes(name=name, tag=name, semantics_version="v/1")),
        "victim",
    )
    victim.start()
    for registration in (*attackers, victim):
        registration.join(timeout=300)
    violations: list[Violation] = []
    outcomes = [registration.outcome for registration in attackers]
    # Refused by the tenant's share of the queue (the daemon's decision, read from its answer,
    # not from a clock); a compile starved of CPU on a loaded machine also ends `unavailable`,
    # retryable, and is no refusal of the share.
    refused = [r for r in attackers if r.outcome == "unavailable" and _SHARE_FULL in r.message]
    if len(refused) < 2:
        violations.append(
            Violation(
                "fault",
                _KLASS,
                f"the attacker's registrations past its share were not refused: "
                f"{[(r.outcome, r.message[:80]) for r in attackers]}",
            )
        )
    if any(outcome not in ("registered", "unavailable") for outcome in outcomes):
        violations.append(Violation("unexpected", _KLASS, f"attacker registrations: {outcomes}"))
    registered = sorted(
        (r for r in attackers if r.outcome == "registered"), key=lambda r: r.finished_at
    )
    if victim.outcome != "registered":
        violations.append(
            Violation("fault", _KLASS, f"the victim's registration ended {victim.outcome}")
        )
    elif len(registered) >= 2 and victim.finished_at > registered[1].finished_at:
        violations.append(
            Violation(
                "fault",
                _KLASS,
                "the victim's registration compiled after the attacker's second: the queue "
                "did not take turns between tenants",
            )
        )
    ctx.recorder.add(violations)
    if victim.outcome == "registered":
        ctx.client(ctx.victim).delete(name)
    return {
        "share": share,
        "attacker_outcomes": outcomes,
        "victim_outcome": victim.outcome,
        "victim_took_s": round(victim.took_s, 2),
        "attacker_took_s": [round(r.took_s, 2) for r in attackers],
    }
