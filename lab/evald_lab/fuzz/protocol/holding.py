"""What a caller can make the daemon hold, in bytes: large messages without a valid token (refused
from their metadata, never read), streams that never read the amplified output of ``strop``'s
``replace`` (bounded in bytes, then cut off), and batches whose values add up past the response
limit (every item answered, each typed). Run once every run before the main loop, then drawn like
the other scenarios.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import grpc

from evald.contract import pb
from evald_lab.fuzz.checks import Violation, outcome_label
from evald_lab.fuzz.context import FuzzContext
from evald_lab.fuzz.protocol.raw_calls import (
    KLASS,
    SERVICE,
    raw_channel,
    raw_method,
    record_refusal,
)

__all__ = ["AMPLIFY", "oversized_response", "unauthenticated_flood", "unread_streams"]

#: 6,000 characters of strop input that evaluate to a 60,002-byte value.
AMPLIFY = b'replace("' + b"a" * 6000 + b'", "a", "aaaaaaaaaa")'


def unauthenticated_flood(ctx: FuzzContext, rng: random.Random) -> None:
    """Near-limit messages without a valid token from several threads at once: each refused
    from its metadata (``permission_denied``), none read, the daemon's memory unmoved (the run's
    RSS bound)."""
    size = max(1, (ctx.max_message_bytes - (64 << 10)) // 2100)
    payload = pb.EvaluateBatchRequest(
        items=[pb.EvaluateRequest(evaluator="calc", input=b"1" * 2000) for _ in range(size)]
    ).SerializeToString()
    variants: tuple[tuple[tuple[str, str], ...], ...] = (
        (),
        (("authorization", "Bearer not-a-token"),),
        (("authorization", "Basic eA=="),),
    )
    method = rng.choice(("EvaluateBatch", "Evaluate", "RegisterEvaluator"))

    def one(metadata: tuple[tuple[str, str], ...]) -> None:
        with raw_channel(ctx) as channel:
            try:
                raw_method(channel, method)(payload, timeout=60, metadata=metadata)
            except grpc.RpcError as error:
                record_refusal(ctx, "unauthenticated_flood", error, ("permission_denied",))
                return
        ctx.recorder.add(
            [Violation("tenant_leak", KLASS, "a call without a valid token was served")]
        )
        ctx.recorder.outcome(KLASS, "served", family="unauthenticated_flood")

    threads = [
        threading.Thread(target=one, args=(rng.choice(variants),), name=f"fuzz-flood-{i}")
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def unread_streams(ctx: FuzzContext, rng: random.Random) -> None:
    """Streams whose client sends amplifying work and never reads: the daemon holds a bounded
    number of bytes for them (the RSS bound), keeps serving, and takes the tenant's budget back
    when they end."""
    count = rng.choice((1, 3))
    channels = [
        grpc.insecure_channel(ctx.target, options=(("grpc.http2.bdp_probe", 0),))
        for _ in range(count)
    ]

    def requests() -> Any:
        for batch in range(20):
            yield pb.EvaluateBatchRequest(
                items=[
                    pb.EvaluateRequest(id=f"{batch}.{i}", evaluator="strop", input=AMPLIFY)
                    for i in range(50)
                ]
            )

    try:
        calls = [
            channel.stream_stream(
                f"{SERVICE}/EvaluateStream",
                request_serializer=pb.EvaluateBatchRequest.SerializeToString,
                response_deserializer=pb.EvaluateBatchResponse.FromString,
            )(requests(), timeout=60, metadata=ctx.metadata(ctx.attacker))
            for channel in channels
        ]
        time.sleep(rng.choice((0.5, 1.5)))
        response = ctx.client(ctx.victim)._invoke(
            ctx.client(ctx.victim)._stub.Evaluate,
            pb.EvaluateRequest(evaluator="calc", input=b"17 * 23 + 91", id="unread"),
        )
        if response.value != "482":
            ctx.recorder.add(
                [Violation("unexpected", KLASS, "the victim was not served beside unread streams")]
            )
        for call in calls:
            call.cancel()
    finally:
        for channel in channels:
            channel.close()
    ctx.recorder.outcome(KLASS, "ok", family="unread_streams")


def oversized_response(ctx: FuzzContext, rng: random.Random) -> None:
    """A batch of in-limit items whose values add up past the response limit: every item gets
    its value or its own ``output_too_large``, never a failed call."""
    count = ctx.max_message_bytes // 60_000 + rng.choice((5, 40))
    items = [pb.EvaluateRequest(evaluator="strop", input=AMPLIFY, id=str(i)) for i in range(count)]
    with raw_channel(ctx) as channel:
        stub = channel.unary_unary(
            f"{SERVICE}/EvaluateBatch",
            request_serializer=pb.EvaluateBatchRequest.SerializeToString,
            response_deserializer=pb.EvaluateBatchResponse.FromString,
        )
        try:
            response = stub(
                pb.EvaluateBatchRequest(items=items),
                timeout=120,
                metadata=ctx.metadata(ctx.attacker),
            )
        except grpc.RpcError as error:
            record_refusal(ctx, "oversized_response", error, ("quota_exceeded",))
            ctx.recorder.add(
                [Violation("unexpected", KLASS, "an oversized batch response failed the call")]
            )
            return
    results = list(response.results)
    if [r.id for r in results] != [str(i) for i in range(count)]:
        ctx.recorder.add([Violation("missing_result", KLASS, "oversized batch lost items")])
    for result in results:
        label = outcome_label(result)
        if label == "untyped":
            ctx.recorder.add(
                [Violation("untyped_error", KLASS, "an oversized batch item has no code")]
            )
        ctx.recorder.outcome(KLASS, label, family="oversized_response")
