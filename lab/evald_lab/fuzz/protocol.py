"""Protocol abuse: what a hostile or broken client does to the daemon's gRPC surface.

Each scenario sends a few requests, checks what came back and records one input per request:
malformed and oversized messages, batches over ``max_batch_items``, unknown evaluators (empty,
huge, look-alike, control characters), missing, wrong and malformed tokens, another tenant's
module names (evaluate, delete, list, shadow), deadline extremes, huge ids, streams opened and
abandoned mid-work (their quota must come back), many concurrent streams, streams that turn
corrupt halfway; and what a caller can make the daemon hold: large messages without a valid
token (refused from their metadata, never read), streams that never read the amplified output
of ``strop``'s ``replace`` (bounded in bytes, then cut off), and batches whose values add up past
the response limit (every item answered, each typed). The same classes on the engine data path
are in :mod:`evald_lab.fuzz.data_path`.

A refusal must carry an ``evald-error-code`` (the daemon's typed errors); the only untyped
statuses accepted are the ones gRPC itself produces before the daemon sees the call (a message or
metadata over the transport's limits), and they are counted as such.
"""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import grpc

from evald.contract import pb
from evald_lab.fuzz.checks import Violation, outcome_label
from evald_lab.fuzz.context import FuzzContext, Item

__all__ = ["HOLD_SCENARIOS", "SCENARIOS", "Scenario", "inflight"]

_KLASS = "protocol"
_SERVICE = "/evald.v1.Evaluator"
_UNARY_METHODS = (
    "Evaluate",
    "EvaluateBatch",
    "ListEvaluators",
    "RegisterEvaluator",
    "DeleteEvaluator",
)
#: gRPC statuses the transport returns before the daemon sees a call (no evald code possible).
_TRANSPORT_STATUSES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})

Scenario = Callable[[FuzzContext, random.Random], None]
_T = TypeVar("_T")


class _AioLoop:
    """One event loop thread for every ``grpc.aio`` call of the process.

    grpc.aio binds its completion queue to the loop it first runs on; a fresh ``asyncio.run``
    per scenario (on whichever lane thread) leaves it calling into closed loops. Scenarios submit
    their coroutines here instead.
    """

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def run(cls, coroutine: Coroutine[Any, Any, _T]) -> _T:
        with cls._lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="fuzz-aio-loop", daemon=True).start()
                cls._loop = loop
            loop = cls._loop
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result()


def _raw(channel: grpc.Channel, method: str) -> Callable[..., bytes]:
    call: Callable[..., bytes] = channel.unary_unary(f"{_SERVICE}/{method}")  # bytes in and out
    return call


def _raw_call_error(error: grpc.RpcError) -> tuple[str | None, grpc.StatusCode, str]:
    """(evald code or None, gRPC status, details) of a failed raw call."""
    code: str | None = None
    for key, value in getattr(error, "trailing_metadata", lambda: ())() or ():
        if key == "evald-error-code":
            code = str(value)
    status = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else "") or ""
    return code, status, details


def _refusal(
    ctx: FuzzContext,
    family: str,
    error: grpc.RpcError,
    expected: Sequence[str],
    *,
    transport_ok: bool = False,
) -> None:
    code, status, details = _raw_call_error(error)
    if code is None and transport_ok and status in _TRANSPORT_STATUSES:
        ctx.recorder.outcome(_KLASS, f"transport:{status.name.lower()}", family=family)
        return
    ctx.recorder.outcome(_KLASS, f"call:{code or status.name.lower()}", family=family)
    if code is None:
        ctx.recorder.add(
            [
                Violation(
                    "untyped_error",
                    _KLASS,
                    f"{family}: {status.name} without a code: {details[:160]}",
                )
            ]
        )
        return
    ctx.recorder.add(ctx.checker.call_error(_KLASS, code, details, expected=expected))
    ctx.recorder.add(ctx.checker.text(_KLASS, ctx.attacker, details))


def _channel(ctx: FuzzContext) -> grpc.Channel:
    limit = ctx.max_message_bytes * 2 + (1 << 20)
    return grpc.insecure_channel(
        ctx.target,
        options=(
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ),
    )


# -- scenarios ----------------------------------------------------------------------------------


def malformed_message(ctx: FuzzContext, rng: random.Random) -> None:
    """Random or damaged bytes as a request: parsed (unknown fields skipped) or invalid_argument."""
    method = rng.choice(_UNARY_METHODS)
    kind = rng.randrange(4)
    if kind == 0:
        payload = rng.randbytes(rng.choice((1, 7, 64, 4096)))
    elif kind == 1:
        payload = b"\x0f" + rng.randbytes(16)  # wire type 7: never valid
    elif kind == 2:
        payload = b"\x0a" + bytes([rng.randint(2, 40)]) + rng.randbytes(2)  # truncated field
    else:
        payload = b"\x0a\x04" + rng.choice((b"\xff\xfe\xfd\xfc", b"ca\x80l", b"\xc0\x80ab"))
    with _channel(ctx) as channel:
        try:
            _raw(channel, method)(payload, timeout=30, metadata=ctx.metadata(ctx.attacker))
        except grpc.RpcError as error:
            expected = (
                "invalid_argument",
                "unknown_evaluator",
                "invalid_module",
                "permission_denied",
            )
            _refusal(ctx, "malformed_message", error, expected)
            return
    ctx.recorder.outcome(_KLASS, "parsed", family="malformed_message")


def oversized_message(ctx: FuzzContext, rng: random.Random) -> None:
    """A message over ``max_message_bytes``: refused by the transport, daemon unharmed."""
    size = ctx.max_message_bytes + rng.choice((1, 1024, 1 << 20))
    request = pb.EvaluateRequest(evaluator="calc", input=b"1" * size)
    with _channel(ctx) as channel:
        try:
            _raw(channel, rng.choice(("Evaluate", "RegisterEvaluator")))(
                request.SerializeToString(), timeout=60, metadata=ctx.metadata(ctx.attacker)
            )
        except grpc.RpcError as error:
            _refusal(ctx, "oversized_message", error, ("invalid_argument",), transport_ok=True)
            return
    ctx.recorder.add([Violation("unexpected", _KLASS, f"a {size}-byte message was accepted")])
    ctx.recorder.outcome(_KLASS, "accepted", family="oversized_message")


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
        _refusal(ctx, "oversized_batch", error, ("invalid_argument",))
        return
    ctx.recorder.add([Violation("unexpected", _KLASS, "a batch over max_batch_items was accepted")])
    ctx.recorder.outcome(_KLASS, "accepted", family="oversized_batch")


def _unknown_names(rng: random.Random) -> list[str]:
    return [
        "",
        " ",
        "CALC",
        "calc ",
        " calc",
        "<calc>",
        "calc\n",
        "calc\x00",
        "../calc",
        "calc/../../etc/passwd",
        "%s%s%n",
        "c" * rng.choice((33, 1000, 100_000)),
        "\u202ecalc",
        "calc\u200b",
        "\uff43\uff41\uff4c\uff43",
        "😀",
        f"nosuch_{rng.getrandbits(32):08x}",
        "standard",
        "*",
    ]


def unknown_evaluators(ctx: FuzzContext, rng: random.Random) -> None:
    names = _unknown_names(rng)
    items = [Item(name, b"1+1", "unknown_evaluator") for name in rng.sample(names, 8)]
    for request, response in ctx.send(_KLASS, ctx.attacker, items):
        if response is not None and outcome_label(response) not in (
            "unknown_evaluator",
            "permission_denied",
        ):
            ctx.recorder.add(
                [
                    Violation(
                        "unexpected",
                        _KLASS,
                        f"evaluator {request.evaluator[:40]!r} gave {outcome_label(response)}",
                    )
                ]
            )


def _token_variants(
    ctx: FuzzContext, rng: random.Random
) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    good = ctx.tokens[ctx.attacker]
    return [
        ("no_token", ()),
        ("wrong_token", (("authorization", f"Bearer {rng.getrandbits(128):032x}"),)),
        ("empty_bearer", (("authorization", "Bearer "),)),
        ("basic_scheme", (("authorization", f"Basic {good}"),)),
        ("token_without_scheme", (("authorization", good),)),
        ("truncated_token", (("authorization", f"Bearer {good[:-1]}"),)),
        ("token_prefix_match", (("authorization", f"Bearer {good}x"),)),
        ("victim_token_case", (("authorization", f"Bearer {ctx.tokens[ctx.victim].upper()}"),)),
        ("huge_token", (("authorization", "Bearer " + "t" * rng.choice((4000, 20_000))),)),
    ]


def bad_tokens(ctx: FuzzContext, rng: random.Random) -> None:
    """Missing, wrong and malformed tokens on every method: permission_denied, never data."""
    label, metadata = rng.choice(_token_variants(ctx, rng))
    method = rng.choice(_UNARY_METHODS)
    request = {
        "Evaluate": pb.EvaluateRequest(evaluator=ctx.secrets.victim_echo or "calc", input=b"1"),
        "EvaluateBatch": pb.EvaluateBatchRequest(
            items=[pb.EvaluateRequest(evaluator="calc", input=b"1")]
        ),
        "ListEvaluators": pb.ListEvaluatorsRequest(),
        "RegisterEvaluator": pb.RegisterEvaluatorRequest(module=b"\0asm"),
        "DeleteEvaluator": pb.DeleteEvaluatorRequest(name=ctx.secrets.victim_secret or "x"),
    }[method]
    with _channel(ctx) as channel:
        try:
            _raw(channel, method)(request.SerializeToString(), timeout=30, metadata=metadata)
        except grpc.RpcError as error:
            _refusal(ctx, f"token:{label}", error, ("permission_denied",), transport_ok=True)
            return
    ctx.recorder.add([Violation("tenant_leak", _KLASS, f"{method} with {label} was served")])
    ctx.recorder.outcome(_KLASS, "served", family=f"token:{label}")


def _shape(message: str, name: str) -> str:
    return message.replace(repr(name), "NAME").replace(name, "NAME")


def foreign_modules(ctx: FuzzContext, rng: random.Random) -> None:
    """The attacker names the victim's modules: it must learn nothing, change nothing."""
    secret = ctx.secrets.victim_secret
    if not secret:
        return
    attacker = ctx.client(ctx.attacker)
    victim = ctx.client(ctx.victim)
    decoy = f"nosuch_{rng.getrandbits(40):010x}"
    results = ctx.send(
        _KLASS,
        ctx.attacker,
        [Item(secret, b"1", "foreign_evaluate"), Item(decoy, b"1", "foreign_evaluate")],
    )
    (_, on_secret), (_, on_decoy) = results
    if on_secret is not None and on_decoy is not None:
        if outcome_label(on_secret) != outcome_label(on_decoy) or _shape(
            on_secret.error.message, secret
        ) != _shape(on_decoy.error.message, decoy):
            ctx.recorder.add(
                [
                    Violation(
                        "tenant_leak",
                        _KLASS,
                        "calling another tenant's module differs from calling a name that does "
                        f"not exist: {on_secret.error.message[:100]!r} vs "
                        f"{on_decoy.error.message[:100]!r}",
                    )
                ]
            )
    action = rng.randrange(3)
    if action == 0:
        for name in (secret, decoy):
            try:
                attacker.delete(name)
            except Exception as error:  # CallError
                code = getattr(error, "code", None)
                ctx.recorder.outcome(
                    _KLASS, f"call:{code.value if code else 'unreachable'}", family="foreign_delete"
                )
                ctx.recorder.add(
                    ctx.checker.call_error(
                        _KLASS,
                        code.value if code else None,
                        str(error),
                        expected=("unknown_evaluator",),
                    )
                )
            else:
                ctx.recorder.outcome(_KLASS, "deleted", family="foreign_delete")
                ctx.recorder.add(
                    [Violation("tenant_leak", _KLASS, f"the attacker deleted {name!r}")]
                )
    elif action == 1:
        listing = attacker.list_evaluators()
        ctx.recorder.outcome(_KLASS, "ok", family="foreign_list")
        names = {info.name for info in listing}
        if secret in names:
            ctx.recorder.add(
                [
                    Violation(
                        "tenant_leak", _KLASS, "the attacker's listing shows the victim's module"
                    )
                ]
            )
        ctx.recorder.add(ctx.checker.text(_KLASS, ctx.attacker, repr(listing)))
    else:
        listing = victim.list_evaluators()
        ctx.recorder.outcome(_KLASS, "ok", family="victim_list")
        ctx.recorder.add(ctx.checker.text(_KLASS, ctx.victim, repr(listing)))
    # the victim's module still answers, with the victim's data
    canary = f"{ctx.secrets.victim_canary}-{rng.getrandbits(32):08x}".encode()
    for _, response in ctx.send(_KLASS, ctx.victim, [Item(secret, canary, "victim_still_served")]):
        if response is None or outcome_label(response) != "ok" or response.value.encode() != canary:
            ctx.recorder.add(
                [
                    Violation(
                        "tenant_leak", _KLASS, "the victim's module no longer returns its input"
                    )
                ]
            )


def deadline_extremes(ctx: FuzzContext, rng: random.Random) -> None:
    """Requested deadlines 0 (the tenant's), 1 ms and 2^32-1 ms (capped to the tenant's)."""
    loop = ctx.secrets.attacker_loop
    if not loop:
        return
    deadlines = rng.sample((0, 1, 2, 5, 2**32 - 1, 2**31), 3)
    ctx.send(_KLASS, ctx.attacker, [Item(loop, b"x", "deadline_extremes", d) for d in deadlines])


def huge_ids(ctx: FuzzContext, rng: random.Random) -> None:
    """Correlation ids of up to 100,000 characters are echoed exactly."""
    size = rng.choice((0, 1000, 100_000))
    request = pb.EvaluateRequest(evaluator="calc", input=b"6*7", id="i" * size + str(rng.random()))
    client = ctx.client(ctx.attacker)
    response = client._invoke(client._stub.Evaluate, request)
    ctx.recorder.outcome(_KLASS, outcome_label(response), family="huge_id")
    ctx.settle(
        _KLASS,
        ctx.attacker,
        ctx.checker.evaluation(_KLASS, ctx.attacker, request, response),
        [(request, response)],
    )


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
            method = channel.stream_stream(f"{_SERVICE}/EvaluateStream")
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

    _AioLoop.run(abandon())
    for _ in range(streams * per_stream):
        ctx.recorder.outcome(_KLASS, "abandoned", family="abandoned_stream")
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
                        _KLASS,
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
            f"{_SERVICE}/EvaluateStream",
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
    _AioLoop.run(run())
    ctx.recorder.call(_KLASS, (time.monotonic() - started) * 1000)
    for requests, got, failure in results:
        if failure is not None:
            ctx.recorder.add(
                [
                    Violation(
                        "unexpected",
                        _KLASS,
                        f"one of {streams} concurrent streams failed: {failure}",
                    )
                ]
            )
        violations, matched = ctx.checker.batch(_KLASS, tenant, requests, got, ordered=False)
        ctx.settle(_KLASS, tenant, violations, zip(requests, matched, strict=True))
        for response in matched:
            ctx.recorder.outcome(
                _KLASS,
                outcome_label(response) if response is not None else "missing",
                family="concurrent_streams",
            )


def corrupt_stream(ctx: FuzzContext, rng: random.Random) -> None:
    """A stream that sends good work, then garbage: invalid_argument, and the daemon serves on."""
    good = pb.EvaluateBatchRequest(
        items=[pb.EvaluateRequest(evaluator="calc", input=b"2+2", id="g")]
    )
    garbage = rng.choice((b"\x0f\xff", b"\x0a\x05\x0a\x02\xff\xfe", rng.randbytes(32)))
    with _channel(ctx) as channel:
        call = channel.stream_stream(f"{_SERVICE}/EvaluateStream")
        try:
            list(
                call(
                    iter([good.SerializeToString(), garbage]),
                    timeout=30,
                    metadata=ctx.metadata(ctx.attacker),
                )
            )
        except grpc.RpcError as error:
            _refusal(ctx, "corrupt_stream", error, ("invalid_argument",))
            return
    ctx.recorder.outcome(_KLASS, "parsed", family="corrupt_stream")  # random bytes that parse


def empty_messages(ctx: FuzzContext, rng: random.Random) -> None:
    """An empty batch, a stream of empty messages, a stream with no message at all."""
    client = ctx.client(ctx.attacker)
    kind = rng.randrange(3)
    if kind == 0:
        response = client._invoke(client._stub.EvaluateBatch, pb.EvaluateBatchRequest())
        if len(response.results) != 0:
            ctx.recorder.add(
                [Violation("missing_result", _KLASS, "an empty batch returned results")]
            )
    else:
        batches: list[list[pb.EvaluateRequest]] = [[] for _ in range(kind * 3 - 3)]
        if client.evaluate_stream(batches):
            ctx.recorder.add(
                [Violation("missing_result", _KLASS, "an empty stream returned results")]
            )
    ctx.recorder.outcome(_KLASS, "ok", family="empty_messages")


#: 6,000 characters of strop input that evaluate to a 60,002-byte value.
_AMPLIFY = b'replace("' + b"a" * 6000 + b'", "a", "aaaaaaaaaa")'


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
        with _channel(ctx) as channel:
            try:
                _raw(channel, method)(payload, timeout=60, metadata=metadata)
            except grpc.RpcError as error:
                _refusal(ctx, "unauthenticated_flood", error, ("permission_denied",))
                return
        ctx.recorder.add(
            [Violation("tenant_leak", _KLASS, "a call without a valid token was served")]
        )
        ctx.recorder.outcome(_KLASS, "served", family="unauthenticated_flood")

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
                    pb.EvaluateRequest(id=f"{batch}.{i}", evaluator="strop", input=_AMPLIFY)
                    for i in range(50)
                ]
            )

    try:
        calls = [
            channel.stream_stream(
                f"{_SERVICE}/EvaluateStream",
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
                [Violation("unexpected", _KLASS, "the victim was not served beside unread streams")]
            )
        for call in calls:
            call.cancel()
    finally:
        for channel in channels:
            channel.close()
    ctx.recorder.outcome(_KLASS, "ok", family="unread_streams")


def oversized_response(ctx: FuzzContext, rng: random.Random) -> None:
    """A batch of in-limit items whose values add up past the response limit: every item gets
    its value or its own ``output_too_large``, never a failed call."""
    count = ctx.max_message_bytes // 60_000 + rng.choice((5, 40))
    items = [pb.EvaluateRequest(evaluator="strop", input=_AMPLIFY, id=str(i)) for i in range(count)]
    with _channel(ctx) as channel:
        stub = channel.unary_unary(
            f"{_SERVICE}/EvaluateBatch",
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
            _refusal(ctx, "oversized_response", error, ("quota_exceeded",))
            ctx.recorder.add(
                [Violation("unexpected", _KLASS, "an oversized batch response failed the call")]
            )
            return
    results = list(response.results)
    if [r.id for r in results] != [str(i) for i in range(count)]:
        ctx.recorder.add([Violation("missing_result", _KLASS, "oversized batch lost items")])
    for result in results:
        label = outcome_label(result)
        if label == "untyped":
            ctx.recorder.add(
                [Violation("untyped_error", _KLASS, "an oversized batch item has no code")]
            )
        ctx.recorder.outcome(_KLASS, label, family="oversized_response")


# The data path's scenarios (evald_lab.fuzz.data_path) are drawn and held with these.
from evald_lab.fuzz.data_path import DATA_HOLD_SCENARIOS, DATA_SCENARIOS  # noqa: E402

SCENARIOS: tuple[tuple[str, Scenario, float], ...] = (
    ("malformed_message", malformed_message, 6.0),
    ("oversized_message", oversized_message, 0.3),
    ("oversized_batch", oversized_batch, 0.5),
    ("unknown_evaluators", unknown_evaluators, 3.0),
    ("bad_tokens", bad_tokens, 6.0),
    ("foreign_modules", foreign_modules, 3.0),
    ("deadline_extremes", deadline_extremes, 1.0),
    ("huge_ids", huge_ids, 1.0),
    ("abandoned_streams", abandoned_streams, 0.5),
    ("many_streams", many_streams, 0.5),
    ("corrupt_stream", corrupt_stream, 2.0),
    ("empty_messages", empty_messages, 1.0),
    ("unauthenticated_flood", unauthenticated_flood, 0.3),
    ("unread_streams", unread_streams, 0.3),
    ("oversized_response", oversized_response, 0.3),
    *DATA_SCENARIOS,
)
"""Every scenario with its weight (how often a protocol step picks it)."""

#: Run once per run before the main loop (and drawn in it like the others): what a caller can
#: make the daemon hold.
HOLD_SCENARIOS: tuple[Scenario, ...] = (
    unauthenticated_flood,
    unread_streams,
    oversized_response,
    *DATA_HOLD_SCENARIOS,
)
