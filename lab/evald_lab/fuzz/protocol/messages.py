"""Malformed and extreme requests: what a broken client sends.

Random or damaged bytes as a request, a message over ``max_message_bytes``, a batch over
``max_batch_items``, deadline extremes, 100,000-character ids, empty messages. Each must be
parsed or refused with a typed code, and the daemon serves on.
"""

from __future__ import annotations

import random

import grpc

from evald.contract import pb
from evald_lab.fuzz.checks import Violation, outcome_label
from evald_lab.fuzz.context import FuzzContext, Item
from evald_lab.fuzz.protocol.raw_calls import (
    KLASS,
    UNARY_METHODS,
    raw_channel,
    raw_method,
    record_refusal,
)

__all__ = [
    "deadline_extremes",
    "empty_messages",
    "huge_ids",
    "malformed_message",
    "oversized_batch",
    "oversized_message",
]


def malformed_message(ctx: FuzzContext, rng: random.Random) -> None:
    """Random or damaged bytes as a request: parsed (unknown fields skipped) or invalid_argument."""
    method = rng.choice(UNARY_METHODS)
    kind = rng.randrange(4)
    if kind == 0:
        payload = rng.randbytes(rng.choice((1, 7, 64, 4096)))
    elif kind == 1:
        payload = b"\x0f" + rng.randbytes(16)  # wire type 7: never valid
    elif kind == 2:
        payload = b"\x0a" + bytes([rng.randint(2, 40)]) + rng.randbytes(2)  # truncated field
    else:
        payload = b"\x0a\x04" + rng.choice((b"\xff\xfe\xfd\xfc", b"ca\x80l", b"\xc0\x80ab"))
    with raw_channel(ctx) as channel:
        try:
            raw_method(channel, method)(payload, timeout=30, metadata=ctx.metadata(ctx.attacker))
        except grpc.RpcError as error:
            expected = (
                "invalid_argument",
                "unknown_evaluator",
                "invalid_module",
                "permission_denied",
            )
            record_refusal(ctx, "malformed_message", error, expected)
            return
    ctx.recorder.outcome(KLASS, "parsed", family="malformed_message")


def oversized_message(ctx: FuzzContext, rng: random.Random) -> None:
    """A message over ``max_message_bytes``: refused by the transport, daemon unharmed."""
    size = ctx.max_message_bytes + rng.choice((1, 1024, 1 << 20))
    request = pb.EvaluateRequest(evaluator="calc", input=b"1" * size)
    with raw_channel(ctx) as channel:
        try:
            raw_method(channel, rng.choice(("Evaluate", "RegisterEvaluator")))(
                request.SerializeToString(), timeout=60, metadata=ctx.metadata(ctx.attacker)
            )
        except grpc.RpcError as error:
            record_refusal(
                ctx, "oversized_message", error, ("invalid_argument",), transport_ok=True
            )
            return
    ctx.recorder.add([Violation("unexpected", KLASS, f"a {size}-byte message was accepted")])
    ctx.recorder.outcome(KLASS, "accepted", family="oversized_message")


def oversized_batch(ctx: FuzzContext, rng: random.Random) -> None:
    """One item over ``max_batch_items`` in a unary batch and in a stream message."""
    items = [
        pb.EvaluateRequest(evaluator="calc", input=b"1", id=str(i))
        for i in range(ctx.max_batch_items + 1)
    ]
    client = ctx.client(ctx.attacker)
    stub = client._stub
    try:
        if rng.random() < 0.5:
            stub.EvaluateBatch(
                pb.EvaluateBatchRequest(items=items),
                timeout=60,
                metadata=ctx.metadata(ctx.attacker),
            )
        else:
            list(
                stub.EvaluateStream(
                    iter([pb.EvaluateBatchRequest(items=items)]),
                    timeout=60,
                    metadata=ctx.metadata(ctx.attacker),
                )
            )
    except grpc.RpcError as error:
        record_refusal(ctx, "oversized_batch", error, ("invalid_argument",))
        return
    ctx.recorder.add([Violation("unexpected", KLASS, "a batch over max_batch_items was accepted")])
    ctx.recorder.outcome(KLASS, "accepted", family="oversized_batch")


def deadline_extremes(ctx: FuzzContext, rng: random.Random) -> None:
    """Requested deadlines 0 (the tenant's), 1 ms and 2^32-1 ms (capped to the tenant's)."""
    loop = ctx.secrets.attacker_loop
    if not loop:
        return
    deadlines = rng.sample((0, 1, 2, 5, 2**32 - 1, 2**31), 3)
    ctx.send(KLASS, ctx.attacker, [Item(loop, b"x", "deadline_extremes", d) for d in deadlines])


def huge_ids(ctx: FuzzContext, rng: random.Random) -> None:
    """Correlation ids of up to 100,000 characters are echoed exactly."""
    size = rng.choice((0, 1000, 100_000))
    request = pb.EvaluateRequest(evaluator="calc", input=b"6*7", id="i" * size + str(rng.random()))
    client = ctx.client(ctx.attacker)
    response = client._invoke(client._stub.Evaluate, request)
    ctx.recorder.outcome(KLASS, outcome_label(response), family="huge_id")
    ctx.settle(
        KLASS,
        ctx.attacker,
        ctx.checker.evaluation(KLASS, ctx.attacker, request, response),
        [(request, response)],
    )


def empty_messages(ctx: FuzzContext, rng: random.Random) -> None:
    """An empty batch, a stream of empty messages, a stream with no message at all."""
    client = ctx.client(ctx.attacker)
    kind = rng.randrange(3)
    if kind == 0:
        response = client._invoke(client._stub.EvaluateBatch, pb.EvaluateBatchRequest())
        if len(response.results) != 0:
            ctx.recorder.add(
                [Violation("missing_result", KLASS, "an empty batch returned results")]
            )
    else:
        batches: list[list[pb.EvaluateRequest]] = [[] for _ in range(kind * 3 - 3)]
        if client.evaluate_stream(batches):
            ctx.recorder.add(
                [Violation("missing_result", KLASS, "an empty stream returned results")]
            )
    ctx.recorder.outcome(KLASS, "ok", family="empty_messages")
