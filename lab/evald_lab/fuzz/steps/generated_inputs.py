"""The ``generated`` class: sentences of the evaluators' own input grammars, and mutations of them.

A quarter of a step's items are fresh sentences and the rest mutations of those (generation
costs about a millisecond an input in Python, a mutation tens of microseconds). When the victim
sends, a few items carry its canary (through its echo module or ``strop``): if any ever shows up
in the attacker's responses, tenants leak. The victim's echo module must return its own input.
"""

from __future__ import annotations

import random

from evald.contract import pb
from evald_lab.fuzz.checks import Violation
from evald_lab.fuzz.context import FuzzContext, Item
from evald_lab.fuzz.generate import mutate
from evald_lab.fuzz.preparation import Arsenal

__all__ = ["generated_step"]

_KLASS = "generated"
#: The share of a victim step's items that carry its canary.
_CANARY_RATE = 0.03


def generated_step(arsenal: Arsenal, rng: random.Random) -> None:
    """One batch or stream (half each) of generated and mutated inputs, as either tenant."""
    ctx = arsenal.ctx
    tenant = ctx.victim if rng.random() < 0.5 else ctx.attacker
    items = _draw_items(arsenal, tenant, rng)
    results = ctx.send(_KLASS, tenant, items, via="stream" if rng.random() < 0.5 else "batch")
    _check_victim_echo(ctx, results)


def _draw_items(arsenal: Arsenal, tenant: str, rng: random.Random) -> list[Item]:
    ctx, generators = arsenal.ctx, arsenal.generators
    names = sorted(generators)
    size = arsenal.profile.generated_batch
    pool: list[tuple[str, bytes]] = []
    for _ in range(max(8, size // 4)):
        name = rng.choice(names)
        pool.append((name, generators[name].generate(rng).encode("utf-8", "surrogatepass")))
    items: list[Item] = []
    for index in range(size):
        if tenant == ctx.victim and rng.random() < _CANARY_RATE:
            items.append(_canary_item(ctx, rng))
            continue
        if index < len(pool):
            name, data = pool[index]
            items.append(Item(name, data, f"{name}:valid"))
            continue
        name, data = rng.choice(pool)
        data = mutate(data, rng, other=rng.choice(pool)[1])
        items.append(Item(name, data, f"{name}:mutated"))
    return items


def _canary_item(ctx: FuzzContext, rng: random.Random) -> Item:
    """The victim's canary, through its echo module (a third) or ``strop``."""
    canary = f"{ctx.secrets.victim_canary}-{rng.getrandbits(32):08x}"
    choice = rng.randrange(3)
    if choice == 0:
        return Item(ctx.secrets.victim_echo, canary.encode(), "victim_canary_echo")
    op = ("upper", "reverse")[choice - 1]
    return Item("strop", f'{op}("{canary}")'.encode(), "victim_canary_strop")


def _check_victim_echo(
    ctx: FuzzContext, results: list[tuple[pb.EvaluateRequest, pb.EvaluateResponse | None]]
) -> None:
    for request, response in results:
        if response is None or not request.evaluator.startswith("v_echo_"):
            continue
        if response.WhichOneof("outcome") != "value" or response.value.encode() != request.input:
            ctx.recorder.add(
                [
                    Violation(
                        "tenant_leak",
                        _KLASS,
                        "the victim's echo module did not return its own input",
                    )
                ]
            )
