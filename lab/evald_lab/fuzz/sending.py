"""Sending evaluations the way an engine does: ``EvaluateBatch`` calls or ``EvaluateStream``
messages as large as the daemon accepts, by item count and by bytes.

A call is given a bound (every item running to its deadline, spread over the daemon's workers,
plus margins) and its wall time is held to it; a call-level failure is recorded against every
item it carried (an unreachable daemon is a crash, or a hang when the call took a second or more;
a refused well-formed call is unexpected).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Protocol

from evald.client import CallError
from evald.contract import pb
from evald_lab.fuzz.checks import TenantBounds, Violation
from evald_lab.fuzz.settling import Pairs, Settler, check_latency, record_results

__all__ = ["Sender", "call_bound_s", "chunked", "send_batch", "send_stream"]


class Sender(Settler, Protocol):
    """What sending needs of the run beyond settling: each tenant's bounds and the daemon's
    worker count, to give a call its time bound."""

    bounds: dict[str, TenantBounds]
    threads: int

#: Room left in a message for everything but the inputs (ids, names, framing).
_MESSAGE_SLACK = 64 * 1024


def chunked(
    requests: list[pb.EvaluateRequest], *, max_items: int, max_message_bytes: int
) -> Iterator[list[pb.EvaluateRequest]]:
    """``requests`` in order, in chunks of at most ``max_items`` that fit one message."""
    budget = max_message_bytes - _MESSAGE_SLACK
    chunk: list[pb.EvaluateRequest] = []
    size = 0
    for request in requests:
        item_size = len(request.input) + len(request.evaluator) + len(request.id) + 16
        if chunk and (len(chunk) >= max_items or size + item_size > budget):
            yield chunk
            chunk, size = [], 0
        chunk.append(request)
        size += item_size
    if chunk:
        yield chunk


def call_bound_s(ctx: Sender, tenant: str, requests: Sequence[pb.EvaluateRequest]) -> float:
    """How long a call carrying ``requests`` may take: every item running to its deadline,
    spread over the daemon's workers, plus a per-item and a fixed margin."""
    bounds = ctx.bounds[tenant]
    total_ms = sum(bounds.effective_deadline_ms(r.deadline_ms) for r in requests)
    return (total_ms / max(1, ctx.threads) + 2.0 * len(requests)) / 1000 + 5.0


def send_batch(
    ctx: Sender,
    klass: str,
    tenant: str,
    requests: list[pb.EvaluateRequest],
    families: dict[str, str],
) -> Pairs:
    """One ``EvaluateBatch`` call (results in order)."""
    bound_s = call_bound_s(ctx, tenant, requests)
    client = ctx.client(tenant, timeout_s=bound_s + 30.0)
    started = time.monotonic()
    try:
        response: pb.EvaluateBatchResponse = client._invoke(
            client._stub.EvaluateBatch, pb.EvaluateBatchRequest(items=requests)
        )
    except CallError as error:
        return _call_failed(ctx, klass, requests, families, error, time.monotonic() - started)
    elapsed = time.monotonic() - started
    ctx.recorder.call(klass, elapsed * 1000)

    def again() -> float:
        began = time.monotonic()
        client._invoke(client._stub.EvaluateBatch, pb.EvaluateBatchRequest(items=requests))
        return time.monotonic() - began

    check_latency(ctx, klass, elapsed, bound_s, f"a batch of {len(requests)}", again)
    return record_results(
        ctx, klass, tenant, requests, list(response.results), families, ordered=True
    )


def send_stream(
    ctx: Sender,
    klass: str,
    tenant: str,
    chunks: list[list[pb.EvaluateRequest]],
    families: dict[str, str],
) -> Pairs:
    """One ``EvaluateStream`` call, a message per chunk (results as they complete)."""
    requests = [request for chunk in chunks for request in chunk]
    if not requests:
        return []
    bound_s = call_bound_s(ctx, tenant, requests)
    client = ctx.client(tenant, timeout_s=bound_s + 30.0)
    started = time.monotonic()
    try:
        responses = client.evaluate_stream(chunks, timeout_s=bound_s + 30.0)
    except CallError as error:
        return _call_failed(ctx, klass, requests, families, error, time.monotonic() - started)
    elapsed = time.monotonic() - started
    ctx.recorder.call(klass, elapsed * 1000)

    def again() -> float:
        began = time.monotonic()
        client.evaluate_stream(chunks, timeout_s=bound_s + 30.0)
        return time.monotonic() - began

    check_latency(ctx, klass, elapsed, bound_s, f"a stream of {len(requests)}", again)
    return record_results(ctx, klass, tenant, requests, responses, families, ordered=False)


def _call_failed(
    ctx: Sender,
    klass: str,
    requests: list[pb.EvaluateRequest],
    families: dict[str, str],
    error: CallError,
    elapsed_s: float,
) -> Pairs:
    code = error.code.value if error.code is not None else "unreachable"
    violations: list[Violation] = []
    if error.code is None:
        kind = "hang" if elapsed_s >= 1.0 else "crash"
        violations.append(
            Violation(kind, klass, f"a call of {len(requests)} items failed: {error.message}")
        )
    else:
        violations.extend(ctx.checker.call_error(klass, code, error.message, expected=()))
        violations.append(
            Violation(
                "unexpected",
                klass,
                f"a well-formed call of {len(requests)} items was refused: {error}",
            )
        )
    ctx.recorder.add(violations)
    for request in requests:
        ctx.recorder.outcome(klass, f"call:{code}", family=families.get(request.id, ""))
    return [(request, None) for request in requests]
