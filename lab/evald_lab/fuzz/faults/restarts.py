"""Two faults that need the daemon stopped and started again, on the run's own daemon.

* **SIGTERM while compiling**: the attacker's heavy registrations compile and wait, the victim's
  waits behind them, and the daemon gets SIGTERM. Every caller must get a typed answer — the
  module registered, or ``unavailable`` — never an untyped ``CANCELLED`` or a dropped call, and
  the daemon must exit 0 within its grace period (plus the margin): a compilation still running
  at the grace period is ended, the waiting ones at once. Before, the daemon took 19.8 s with a
  10 s grace and the waiting callers got ``CANCELLED``.
* **The state folder checked at load**: with the daemon stopped, the victim's index gets an
  entry ``calc`` and an entry under another name, both pointing at its echo module; after the
  restart the victim's ``calc`` must be the standard one, the renamed entry not served, and the
  victim's own module still answering. The index is then restored and the daemon restarted.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from evald.client import CallError
from evald.contract import append_custom_section
from evald.testing import guest, manifest_bytes
from evald_lab.fuzz.checks import Violation, outcome_label
from evald_lab.fuzz.context import FuzzContext
from evald_lab.fuzz.daemon_under_test import DaemonUnderTest
from evald_lab.fuzz.noisy import heavy_module

__all__ = ["sigterm_while_compiling", "state_folder_at_load"]

_SIGTERM = "fault_sigterm_compiling"
_STATE = "fault_state_folder"


def _stop(daemon: DaemonUnderTest, timeout_s: float = 60.0) -> int:
    """SIGTERM to the run's own daemon; its exit status."""
    assert daemon.process is not None
    return daemon.process.stop(timeout_s=timeout_s)


def _restart(ctx: FuzzContext, daemon: DaemonUnderTest) -> None:
    """Starts the daemon again; the run's clients are replaced by fresh ones (a channel to the
    stopped daemon may sit in its reconnect backoff)."""
    daemon.restart()
    ctx.close()


def sigterm_while_compiling(
    ctx: FuzzContext, daemon: DaemonUnderTest, *, grace_s: float
) -> dict[str, Any]:
    """SIGTERM with registrations compiling and waiting; returns the report section."""
    outcomes: list[tuple[str, str]] = []
    lock = threading.Lock()
    base = heavy_module(f"sigterm_{ctx.secrets.attacker_canary[-6:]}")

    def register(tenant: str, wasm: bytes) -> None:
        try:
            ctx.client(tenant, timeout_s=grace_s + 60).register(wasm, replace=True)
            label = "registered"
        except CallError as error:
            label = error.code.value if error.code is not None else "unreachable"
        with lock:
            outcomes.append((tenant, label))
        ctx.recorder.outcome(_SIGTERM, label, family=tenant)

    callers = [
        threading.Thread(
            target=register,
            args=(ctx.attacker, append_custom_section(base, "pad", bytes([index]))),
            name=f"fuzz-sigterm-{index}",
        )
        for index in range(2)
    ]
    victim_name = f"sigterm_v_{ctx.secrets.victim_canary[-6:]}"
    manifest = manifest_bytes(name=victim_name, tag=victim_name, semantics_version="v/1")
    callers.append(
        threading.Thread(target=register, args=(ctx.victim, guest("echo", manifest=manifest)))
    )
    for caller in callers:
        caller.start()
        time.sleep(0.2)  # in this order: the attacker's first compiles, the others wait
    signalled = time.monotonic()
    status = _stop(daemon, timeout_s=grace_s + 60)
    exited_s = time.monotonic() - signalled
    for caller in callers:
        caller.join(timeout=grace_s + 60)
    violations: list[Violation] = []
    untyped = [
        (tenant, label) for tenant, label in outcomes if label not in ("registered", "unavailable")
    ]
    if untyped or len(outcomes) != len(callers):
        violations.append(
            Violation("fault", _SIGTERM, f"registrations during SIGTERM ended {outcomes}")
        )
    if status != 0:
        violations.append(Violation("crash", _SIGTERM, f"the daemon exited {status} on SIGTERM"))
    if exited_s > grace_s + ctx.margin_ms / 1000 + 2.0:
        violations.append(
            Violation(
                "fault",
                _SIGTERM,
                f"the daemon took {exited_s:.1f} s to exit with a grace period of {grace_s:g} s",
            )
        )
    _restart(ctx, daemon)
    ctx.recorder.add(violations)
    return {
        "grace_s": grace_s,
        "exit_status": status,
        "exited_s": round(exited_s, 2),
        "outcomes": sorted(label for _, label in outcomes),
    }


def state_folder_at_load(ctx: FuzzContext, daemon: DaemonUnderTest) -> dict[str, Any]:
    """Entries added to the victim's index by hand are held to the registration rules at the
    next start; returns the report section."""
    assert daemon.process is not None
    index = Path(daemon.process.state_dir) / "tenants" / f"{ctx.victim}.json"
    original = index.read_bytes()
    document = json.loads(original)
    echo = document["modules"][ctx.secrets.victim_echo]
    renamed = f"{ctx.secrets.victim_echo}_renamed"
    document["modules"]["calc"] = dict(echo)
    document["modules"][renamed] = dict(echo)
    violations: list[Violation] = []
    calc_outcome = renamed_outcome = "not_reached"
    if _stop(daemon) != 0:
        violations.append(Violation("crash", _STATE, "the daemon did not exit 0 on SIGTERM"))
    index.write_text(json.dumps(document))
    try:
        _restart(ctx, daemon)
        client = ctx.client(ctx.victim)
        calc = client.evaluate("calc", "1+1")
        calc_outcome = f"{outcome_label(calc)}:{calc.value}"
        renamed_outcome = outcome_label(client.evaluate(renamed, b"x"))
        canary = ctx.secrets.victim_canary.encode()
        echo_answer = client.evaluate(ctx.secrets.victim_echo, canary)
        for label, family in (
            (calc_outcome, "calc_entry"),
            (renamed_outcome, "renamed_entry"),
            (outcome_label(echo_answer), "own_module"),
        ):
            ctx.recorder.outcome(_STATE, label, family=family)
        if calc_outcome != "ok:2":
            violations.append(
                Violation("tenant_leak", _STATE, f"an index entry 'calc' answered {calc_outcome}")
            )
        if renamed_outcome != "unknown_evaluator":
            violations.append(
                Violation("fault", _STATE, f"an entry renamed by hand answered {renamed_outcome}")
            )
        if echo_answer.value.encode() != canary:
            violations.append(
                Violation("fault", _STATE, "the victim's own module stopped answering")
            )
    finally:
        if daemon.alive():
            _stop(daemon)
        index.write_bytes(original)  # as the run registered it
        _restart(ctx, daemon)
    ctx.recorder.add(violations)
    return {"calc_entry": calc_outcome, "renamed_entry": renamed_outcome}
