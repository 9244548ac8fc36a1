"""A tenant's change is not held up by another tenant's compile: the attacker registers a heavy
module and, while it compiles, the victim deletes one of its own.

The deletion must be answered while the attacker's registration is still compiling: changes
apply on the daemon's control thread, compiles run on its module thread. Before, one control
thread did both, and a revocation or deletion waited for whatever compiled (5.6 s for a
revocation). The order is the daemon's: which of the two answers came first, not a clock.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from evald.client import CallError
from evald.testing import guest, manifest_bytes
from evald_lab.fuzz.checks import Violation
from evald_lab.fuzz.context import FuzzContext
from evald_lab.fuzz.noisy import heavy_module

__all__ = ["changes_while_compiling"]

_KLASS = "control_plane"
#: How long the attacker's registration is given to reach the compile worker first.
_HEAD_START_S = 0.3


def changes_while_compiling(ctx: FuzzContext) -> dict[str, Any]:
    """The victim's deletion during the attacker's heavy registration; returns the report
    section (a violation goes to the recorder)."""
    name = f"ctl_v_{ctx.secrets.victim_canary[-6:]}"
    victim = ctx.client(ctx.victim)
    victim.register(
        guest("echo", manifest=manifest_bytes(name=name, tag=name, semantics_version="v/1")),
        replace=True,
    )
    attacker_done = threading.Event()
    attacker_outcome: list[str] = []

    def attack() -> None:
        wasm = heavy_module(f"ctl_a_{ctx.secrets.attacker_canary[-6:]}")
        try:
            ctx.client(ctx.attacker).register(wasm, replace=True)
            attacker_outcome.append("registered")
        except CallError as error:
            attacker_outcome.append(error.code.value if error.code is not None else "unreachable")
        attacker_done.set()

    thread = threading.Thread(target=attack, name="fuzz-control-plane", daemon=True)
    thread.start()
    time.sleep(_HEAD_START_S)
    sent_while_compiling = not attacker_done.is_set()
    victim.delete(name)
    answered_first = not attacker_done.is_set()
    thread.join(timeout=300)
    if not sent_while_compiling:
        verdict = "inconclusive"  # the attacker's module compiled before the deletion was sent
    elif answered_first:
        verdict = "answered_during_compile"
    else:
        verdict = "waited_for_compile"
        ctx.recorder.add(
            [
                Violation(
                    "fault",
                    _KLASS,
                    "the victim's deletion was answered only after the attacker's module "
                    "compiled: a change waited for another tenant's compile",
                )
            ]
        )
    ctx.recorder.outcome(_KLASS, verdict, family="delete_during_compile")
    return {"verdict": verdict, "attacker_outcome": attacker_outcome[:1]}
