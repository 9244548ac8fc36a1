"""kill -9 under load: the daemon killed with SIGKILL while victim batches are in flight.

Load threads send victim batches with a per-call deadline; the daemon is killed, left down for a
moment and restarted on the same state folder and socket. Every call that was in flight or sent
while it was down must fail with ``unavailable`` (the client's "not reached") within its deadline
plus the margin; every load thread must succeed again after the restart (a client reconnects with
a new channel); every module registered before the kill is listed, with the same hash, and
callable afterwards; and no child of the killed daemon (its compile worker, multiprocessing's
resource tracker) outlives it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from evald.client import CallError, Client
from evald.contract import pb
from evald.testing import guest, manifest_bytes, process_alive, process_descendants
from evald_lab.fuzz.checks import Violation, outcome_label
from evald_lab.fuzz.context import FuzzContext

__all__ = ["kill_under_load"]

_KILL = "fault_kill9"


@dataclass
class _Tally:
    """What the load threads saw; ``killed_at`` and ``up_at`` are set by the fault."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    failures: list[tuple[float, str]] = field(default_factory=list)  # (seconds it took, code)
    successes_after: dict[int, float] = field(default_factory=dict)  # thread: s after restart
    before_kill: int = 0
    failed: int = 0
    after_restart: int = 0
    killed_at: float = 0.0
    up_at: float = 0.0


class _Load:
    """``loaders`` threads sending victim batches of 64 ``calc`` items back to back."""

    def __init__(self, ctx: FuzzContext, *, loaders: int, call_deadline_s: float) -> None:
        self.ctx = ctx
        self.loaders = loaders
        self.call_deadline_s = call_deadline_s
        self.tally = _Tally()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._load, args=(i,), name=f"fuzz-load-{i}", daemon=True)
            for i in range(loaders)
        ]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def wait_recovered(self, timeout_s: float) -> None:
        """Until every thread has succeeded after the restart, or ``timeout_s`` passed."""
        give_up = self.tally.up_at + timeout_s
        while time.monotonic() < give_up and len(self.tally.successes_after) < self.loaders:
            time.sleep(0.05)

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)

    def _client(self) -> Client:
        ctx = self.ctx
        return Client(ctx.target, ctx.tokens[ctx.victim], timeout_s=self.call_deadline_s)

    def _load(self, index: int) -> None:
        ctx, tally = self.ctx, self.tally
        client = self._client()
        items = [
            pb.EvaluateRequest(evaluator="calc", input=f"{index}+{i}".encode(), id=str(i))
            for i in range(64)
        ]
        try:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    response = client._invoke(
                        client._stub.EvaluateBatch, pb.EvaluateBatchRequest(items=items)
                    )
                except CallError as error:
                    took = time.monotonic() - started
                    code = error.code.value if error.code is not None else "unavailable"
                    with tally.lock:
                        tally.failed += 1
                        tally.failures.append((took, code))
                    ctx.recorder.outcome(_KILL, f"call:{code}", family="load")
                    client.close()  # reconnect with a fresh channel (no backoff carried over)
                    client = self._client()
                    time.sleep(0.02)
                    continue
                finished = time.monotonic()
                with tally.lock:
                    if tally.killed_at == 0.0:
                        tally.before_kill += 1
                    elif tally.up_at and started >= tally.up_at:
                        tally.after_restart += 1
                        tally.successes_after.setdefault(index, finished - tally.up_at)
                violations, matched = ctx.checker.batch(
                    _KILL, ctx.victim, items, list(response.results), ordered=True
                )
                ctx.settle(_KILL, ctx.victim, violations, zip(items, matched, strict=True))
                for result in response.results:
                    ctx.recorder.outcome(_KILL, outcome_label(result), family="load")
        finally:
            client.close()


def _owned(client: Client, tenant: str) -> set[tuple[str, str]]:
    return {(info.name, info.sha256) for info in client.list_evaluators() if info.owner == tenant}


def _modules(ctx: FuzzContext) -> dict[str, set[tuple[str, str]]]:
    """Each tenant's modules, as (name, hash)."""
    return {t: _owned(ctx.client(t), t) for t in (ctx.victim, ctx.attacker)}


def kill_under_load(
    ctx: FuzzContext,
    *,
    kill: Callable[[], None],
    restart: Callable[[], None],
    pid: Callable[[], int | None] = lambda: None,
    call_deadline_s: float = 2.0,
    loaders: int = 3,
    down_s: float = 0.5,
) -> dict[str, Any]:
    """kill -9 under load; returns the report section (violations go to the recorder)."""
    # a registration first, so the daemon has its compile worker (and resource tracker) to lose
    name = f"k9_{ctx.secrets.victim_canary[-6:]}"
    manifest = manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1")
    ctx.client(ctx.victim).register(guest("echo", manifest=manifest), replace=True)
    before = _modules(ctx)
    load = _Load(ctx, loaders=loaders, call_deadline_s=call_deadline_s)
    load.start()
    time.sleep(0.5)
    daemon_pid = pid()
    children = process_descendants(daemon_pid) if daemon_pid is not None else {}
    load.tally.killed_at = time.monotonic()
    kill()
    time.sleep(down_s)
    orphans = _orphans(children)
    restart_started = time.monotonic()
    restart()
    load.tally.up_at = time.monotonic()
    load.wait_recovered(30.0)
    load.join()
    tally = load.tally
    violations = _load_verdicts(tally, call_deadline_s, ctx.margin_ms / 1000, loaders)
    after = _modules(ctx)
    lost = {
        t: sorted(name for name, _ in before[t] - after[t]) for t in before if before[t] - after[t]
    }
    if lost:
        violations.append(Violation("fault", _KILL, f"modules lost across kill -9: {lost}"))
    violations.extend(_victim_module_answers(ctx))
    if orphans:
        violations.append(
            Violation("fault", _KILL, f"processes outlived the daemon's kill -9: {orphans}")
        )
    ctx.recorder.add(violations)
    return {
        "loaders": loaders,
        "call_deadline_s": call_deadline_s,
        "calls_before_kill": tally.before_kill,
        "calls_failed": tally.failed,
        "failure_codes": _codes(tally),
        "max_failure_latency_ms": round(
            max((took for took, _ in tally.failures), default=0.0) * 1000, 1
        ),
        "down_s": round(restart_started - tally.killed_at, 3),
        "restart_s": round(tally.up_at - restart_started, 3),
        "recovered_after_ms": round(
            max(tally.successes_after.values(), default=float("nan")) * 1000, 1
        ),
        "calls_after_restart": tally.after_restart,
        "modules_before": sum(len(v) for v in before.values()),
        "modules_after": sum(len(v) for v in after.values()),
        "modules_persisted": not lost,
        "children_before_kill": sorted(_kind(cmd) for cmd in children.values()),
        "children_left_after_kill": sorted(orphans),
    }


def _kind(command: str) -> str:
    """What a child of the daemon is, from its command line."""
    if "resource_tracker" in command:
        return "resource_tracker"
    if "spawn_main" in command:
        return "compile_worker"
    return command[:80]


def _orphans(children: dict[int, str], wait_s: float = 10.0) -> list[str]:
    """Those of the daemon's children still running ``wait_s`` after it was killed (then
    killed, so a run leaves none behind)."""
    give_up = time.monotonic() + wait_s
    while time.monotonic() < give_up and any(process_alive(child) for child in children):
        time.sleep(0.1)
    left = [child for child in children if process_alive(child)]
    for child in left:
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)
    return [_kind(children[child]) for child in left]


def _codes(tally: _Tally) -> dict[str, int]:
    codes: dict[str, int] = {}
    for _, code in tally.failures:
        codes[code] = codes.get(code, 0) + 1
    return codes


def _load_verdicts(
    tally: _Tally, call_deadline_s: float, margin_s: float, loaders: int
) -> list[Violation]:
    """Failed calls must be ``unavailable`` within their deadline, some call must have failed
    (else the kill missed the load), and every thread must have recovered."""
    violations: list[Violation] = []
    slow = [took for took, _ in tally.failures if took > call_deadline_s + margin_s]
    if slow:
        violations.append(
            Violation(
                "fault",
                _KILL,
                f"{len(slow)} calls failed only after {max(slow):.2f} s, past their deadline "
                f"of {call_deadline_s:g} s + margin",
            )
        )
    wrong = {code: n for code, n in _codes(tally).items() if code != "unavailable"}
    if wrong:
        violations.append(Violation("fault", _KILL, f"calls failed with {wrong}, not unavailable"))
    if not tally.failures:
        violations.append(
            Violation("fault", _KILL, "no call failed: the kill did not land under load")
        )
    recovered = len(tally.successes_after)
    if recovered < loaders:
        violations.append(
            Violation(
                "fault",
                _KILL,
                f"{loaders - recovered} of {loaders} clients did not recover in 30 s",
            )
        )
    return violations


def _victim_module_answers(ctx: FuzzContext) -> list[Violation]:
    """The victim's echo module, registered before the kill, answers after the restart."""
    canary = f"{ctx.secrets.victim_canary}-after-restart".encode()
    echo = ctx.client(ctx.victim).evaluate(ctx.secrets.victim_echo, canary)
    if outcome_label(echo) != "ok" or echo.value.encode() != canary:
        return [Violation("fault", _KILL, "the victim's module does not answer after restart")]
    return []
