"""Who a call claims to be and what it names: unknown and look-alike evaluators, missing, wrong
and malformed tokens, and the other tenant's module names (call, delete, list, shadow). A
refusal must be typed and carry nothing of the other tenant.
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

__all__ = ["bad_tokens", "foreign_modules", "unknown_evaluators"]


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
    for request, response in ctx.send(KLASS, ctx.attacker, items):
        if response is not None and outcome_label(response) not in (
            "unknown_evaluator",
            "permission_denied",
        ):
            ctx.recorder.add(
                [
                    Violation(
                        "unexpected",
                        KLASS,
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
    method = rng.choice(UNARY_METHODS)
    request = {
        "Evaluate": pb.EvaluateRequest(evaluator=ctx.secrets.victim_echo or "calc", input=b"1"),
        "EvaluateBatch": pb.EvaluateBatchRequest(
            items=[pb.EvaluateRequest(evaluator="calc", input=b"1")]
        ),
        "ListEvaluators": pb.ListEvaluatorsRequest(),
        "RegisterEvaluator": pb.RegisterEvaluatorRequest(module=b"\0asm"),
        "DeleteEvaluator": pb.DeleteEvaluatorRequest(name=ctx.secrets.victim_secret or "x"),
    }[method]
    with raw_channel(ctx) as channel:
        try:
            raw_method(channel, method)(request.SerializeToString(), timeout=30, metadata=metadata)
        except grpc.RpcError as error:
            record_refusal(ctx, f"token:{label}", error, ("permission_denied",), transport_ok=True)
            return
    ctx.recorder.add([Violation("tenant_leak", KLASS, f"{method} with {label} was served")])
    ctx.recorder.outcome(KLASS, "served", family=f"token:{label}")


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
        KLASS,
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
                        KLASS,
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
                    KLASS, f"call:{code.value if code else 'unreachable'}", family="foreign_delete"
                )
                ctx.recorder.add(
                    ctx.checker.call_error(
                        KLASS,
                        code.value if code else None,
                        str(error),
                        expected=("unknown_evaluator",),
                    )
                )
            else:
                ctx.recorder.outcome(KLASS, "deleted", family="foreign_delete")
                ctx.recorder.add(
                    [Violation("tenant_leak", KLASS, f"the attacker deleted {name!r}")]
                )
    elif action == 1:
        listing = attacker.list_evaluators()
        ctx.recorder.outcome(KLASS, "ok", family="foreign_list")
        names = {info.name for info in listing}
        if secret in names:
            ctx.recorder.add(
                [
                    Violation(
                        "tenant_leak", KLASS, "the attacker's listing shows the victim's module"
                    )
                ]
            )
        ctx.recorder.add(ctx.checker.text(KLASS, ctx.attacker, repr(listing)))
    else:
        listing = victim.list_evaluators()
        ctx.recorder.outcome(KLASS, "ok", family="victim_list")
        ctx.recorder.add(ctx.checker.text(KLASS, ctx.victim, repr(listing)))
    # the victim's module still answers, with the victim's data
    canary = f"{ctx.secrets.victim_canary}-{rng.getrandbits(32):08x}".encode()
    for _, response in ctx.send(KLASS, ctx.victim, [Item(secret, canary, "victim_still_served")]):
        if response is None or outcome_label(response) != "ok" or response.value.encode() != canary:
            ctx.recorder.add(
                [Violation("tenant_leak", KLASS, "the victim's module no longer returns its input")]
            )
