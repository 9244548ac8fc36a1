"""Settling what a call brought back: every result checked and recorded, and a time over its
bound repeated before it counts.

Deadlines are wall-clock time, and a machine that stalls a thread (other processes, CPU steal)
can push one evaluation or one call over its bound. So an evaluation over its deadline bound is
repeated alone, up to three times, and a call over its latency bound up to twice: only one that
is over every time is a violation (a host that fails to stop a guest fails every time); the
others are counted as stalls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

from evald.client import CallError, Client
from evald.contract import pb
from evald_lab.fuzz.checks import Checker, Violation, outcome_label
from evald_lab.fuzz.tally import Recorder

__all__ = ["Settler", "check_latency", "record_results", "settle"]


class Settler(Protocol):
    """What settling needs of the run (:class:`~evald_lab.fuzz.context.FuzzContext` is one):
    the checker, the tally, and a client to repeat a call with."""

    checker: Checker
    recorder: Recorder

    def client(self, tenant: str, *, timeout_s: float = 120.0) -> Client: ...

Pairs = list[tuple[pb.EvaluateRequest, pb.EvaluateResponse | None]]


def record_results(
    ctx: Settler,
    klass: str,
    tenant: str,
    requests: list[pb.EvaluateRequest],
    responses: list[pb.EvaluateResponse],
    families: dict[str, str],
    *,
    ordered: bool,
) -> Pairs:
    """Matches ``responses`` to ``requests`` (by position when ``ordered``, else by id), checks
    and settles them, and records each item's outcome under its family."""
    violations, matched = ctx.checker.batch(klass, tenant, requests, responses, ordered=ordered)
    settle(ctx, klass, tenant, violations, zip(requests, matched, strict=True))
    for request, response in zip(requests, matched, strict=True):
        label = outcome_label(response) if response is not None else "missing"
        ctx.recorder.outcome(
            klass,
            label,
            family=families.get(request.id, ""),
            eval_us=response.eval_time_us if response is not None else 0,
        )
    return list(zip(requests, matched, strict=True))


def settle(
    ctx: Settler,
    klass: str,
    tenant: str,
    violations: Iterable[Violation],
    pairs: Iterable[tuple[pb.EvaluateRequest, pb.EvaluateResponse | None]],
) -> None:
    """Records ``violations``, except that an evaluation over its deadline bound is repeated
    (alone, up to three times) first: only one that is over every time is an escape."""
    ctx.recorder.add(v for v in violations if v.kind != "deadline_escape")
    bounds = ctx.checker.bounds[tenant]
    for request, response in pairs:
        if response is None:
            continue
        ctx.recorder.overrun(
            klass, response.eval_time_us, bounds.effective_deadline_ms(request.deadline_ms)
        )
        if ctx.checker.over_deadline(tenant, request, response):
            _confirm_escape(ctx, klass, tenant, request, response)


def _confirm_escape(
    ctx: Settler,
    klass: str,
    tenant: str,
    request: pb.EvaluateRequest,
    first: pb.EvaluateResponse,
) -> None:
    client = ctx.client(tenant)
    times = [first.eval_time_us]
    for attempt in range(3):
        time.sleep(0.1 * (attempt + 1))
        try:
            again: pb.EvaluateResponse = client._invoke(client._stub.Evaluate, request)
        except CallError:
            continue
        times.append(again.eval_time_us)
        if not ctx.checker.over_deadline(tenant, request, again):
            ctx.recorder.stall(klass, first.eval_time_us / 1000)
            return
    ctx.recorder.add(
        v
        for v in ctx.checker.evaluation(klass, tenant, request, first)
        if v.kind == "deadline_escape"
    )
    ctx.recorder.add([Violation("deadline_escape", klass, f"repeated: eval times {times} us", "")])


def check_latency(
    ctx: Settler,
    klass: str,
    elapsed_s: float,
    bound_s: float,
    what: str,
    again: Callable[[], float],
) -> None:
    """A call's wall time against its bound; over it, the call is repeated (``again`` returns
    the repeat's wall time, up to twice) and only a call that is slow every time is a hang."""
    if not ctx.checker.call_latency(klass, elapsed_s, bound_s, what):
        return
    for _ in range(2):
        time.sleep(0.1)
        try:
            repeated = again()
        except CallError:
            continue
        if not ctx.checker.call_latency(klass, repeated, bound_s, what):
            ctx.recorder.stall(klass, elapsed_s * 1000)
            return
    ctx.recorder.add(ctx.checker.call_latency(klass, elapsed_s, bound_s, what))
