"""Streams misused: opened and abandoned mid-work (the tenant's in-flight quota must come back),
many at once, and turning corrupt halfway.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
import urllib.request
from collections.abc import AsyncIterator

import grpc

from evald.contract import pb
from evald_lab.fuzz.checks import Violation, outcome_label
from evald_lab.fuzz.context import FuzzContext
from evald_lab.fuzz.protocol.raw_calls import (
    KLASS,
    SERVICE,
    AioLoop,
    raw_channel,
    record_refusal,
)

__all__ = ["abandoned_streams", "corrupt_stream", "inflight", "many_streams"]


def inflight(ctx: FuzzContext, tenant: str) -> float | None:
    """The daemon's ``evald_inflight_evaluations`` gauge for ``tenant`` (None: no metrics)."""
    if ctx.metrics_port is None:
        return None
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{ctx.metrics_port}/metrics", timeout=5
        ) as page:
            text = page.read().decode("utf-8", "replace")
    except OSError:
        return None
    match = re.search(
        rf'^evald_inflight_evaluations\{{tenant="{re.escape(tenant)}"\}} ([0-9.e+-]+)$', text, re.M
    )
    return float(match.group(1)) if match else 0.0


def abandoned_streams(ctx: FuzzContext, rng: random.Random) -> None:
    """Streams that send slow work and vanish: their queued items must give their quota back."""
    loop = ctx.secrets.attacker_loop
    if not loop:
        return
    streams = rng.choice((1, 4, 16))
    per_stream = ctx.threads * 4

    async def abandon() -> None:
        async with grpc.aio.insecure_channel(ctx.target) as channel:
            method = channel.stream_stream(f"{SERVICE}/EvaluateStream")
            calls = []
            for s in range(streams):
                message = pb.EvaluateBatchRequest(
                    items=[
                        pb.EvaluateRequest(evaluator=loop, input=b"x", id=f"{s}.{i}")
                        for i in range(per_stream)
                    ]
                )
                call = method(metadata=ctx.metadata(ctx.attacker), timeout=60)
                await call.write(message.SerializeToString())
                calls.append(call)
            await asyncio.sleep(rng.choice((0.0, 0.01, 0.05)))
            for call in calls:
                call.cancel()

    AioLoop.run(abandon())
    for _ in range(streams * per_stream):
        ctx.recorder.outcome(KLASS, "abandoned", family="abandoned_stream")
    # Everything queued must be answered or dropped: in-flight returns to zero.
    bound_s = (
        streams * per_stream * ctx.bounds[ctx.attacker].deadline_ms / 1000 / max(1, ctx.threads)
        + 10.0
    )
    give_up = time.monotonic() + bound_s
    while True:
        count = inflight(ctx, ctx.attacker)
        if count is None or count == 0:
            return
        if time.monotonic() > give_up:
            ctx.recorder.add(
                [
                    Violation(
                        "fault",
                        KLASS,
                        f"{count:g} evaluations still in flight {bound_s:.1f} s after their "
                        "streams were abandoned",
                    )
                ]
            )
            return
        time.sleep(0.05)


def many_streams(ctx: FuzzContext, rng: random.Random) -> None:
    """Many concurrent streams, each several messages, every result accounted for."""
    streams = rng.choice((16, 64, 128))
    messages = rng.choice((1, 3))
    per_message = rng.choice((1, 8, 32))
    tenant = rng.choice((ctx.victim, ctx.attacker))
    results: list[tuple[list[pb.EvaluateRequest], list[pb.EvaluateResponse], str | None]] = []

    async def one(index: int, channel: grpc.aio.Channel) -> None:
        sent = [
            [
                pb.EvaluateRequest(
                    evaluator="calc", input=f"{index}*{m}+{i}".encode(), id=f"{index}.{m}.{i}"
                )
                for i in range(per_message)
            ]
            for m in range(messages)
        ]
        requests = [r for batch in sent for r in batch]
        got: list[pb.EvaluateResponse] = []
        stub = channel.stream_stream(
            f"{SERVICE}/EvaluateStream",
            request_serializer=pb.EvaluateBatchRequest.SerializeToString,
            response_deserializer=pb.EvaluateBatchResponse.FromString,
        )

        async def messages_iter() -> AsyncIterator[pb.EvaluateBatchRequest]:
            for batch in sent:
                yield pb.EvaluateBatchRequest(items=batch)

        try:
            async for message in stub(messages_iter(), metadata=ctx.metadata(tenant), timeout=120):
                got.extend(message.results)
        except grpc.RpcError as error:
            results.append((requests, got, f"{error.code().name}: {error.details()}"))
            return
        results.append((requests, got, None))

    async def run() -> None:
        async with grpc.aio.insecure_channel(ctx.target) as channel:
            await asyncio.gather(*(one(i, channel) for i in range(streams)))

    started = time.monotonic()
    AioLoop.run(run())
    ctx.recorder.call(KLASS, (time.monotonic() - started) * 1000)
    for requests, got, failure in results:
        if failure is not None:
            ctx.recorder.add(
                [
                    Violation(
                        "unexpected",
                        KLASS,
                        f"one of {streams} concurrent streams failed: {failure}",
                    )
                ]
            )
        violations, matched = ctx.checker.batch(KLASS, tenant, requests, got, ordered=False)
        ctx.settle(KLASS, tenant, violations, zip(requests, matched, strict=True))
        for response in matched:
            ctx.recorder.outcome(
                KLASS,
                outcome_label(response) if response is not None else "missing",
                family="concurrent_streams",
            )


def corrupt_stream(ctx: FuzzContext, rng: random.Random) -> None:
    """A stream that sends good work, then garbage: invalid_argument, and the daemon serves on."""
    good = pb.EvaluateBatchRequest(
        items=[pb.EvaluateRequest(evaluator="calc", input=b"2+2", id="g")]
    )
    garbage = rng.choice((b"\x0f\xff", b"\x0a\x05\x0a\x02\xff\xfe", rng.randbytes(32)))
    with raw_channel(ctx) as channel:
        call = channel.stream_stream(f"{SERVICE}/EvaluateStream")
        try:
            list(
                call(
                    iter([good.SerializeToString(), garbage]),
                    timeout=30,
                    metadata=ctx.metadata(ctx.attacker),
                )
            )
        except grpc.RpcError as error:
            record_refusal(ctx, "corrupt_stream", error, ("invalid_argument",))
            return
    ctx.recorder.outcome(KLASS, "parsed", family="corrupt_stream")  # random bytes that parse
