"""The ``modules`` class: calls of the attacker's registered modules, and registrations.

A step calls a draw of the cheap modules and a few heavy ones (each burns the tenant's whole
fuel or deadline) and holds every outcome to the module's table row; the memory probe's value
must stay within the memory limit, and under fresh isolation the ``remember`` module must find
nothing of an earlier call. Now and then (the profile's ``registration_rate``) it also
registers a mutated module or a refused one again.
"""

from __future__ import annotations

import random

from evald.contract import pb
from evald_lab.fuzz.checks import Violation, outcome_label
from evald_lab.fuzz.context import FuzzContext, Item
from evald_lab.fuzz.modules import MaliciousModule
from evald_lab.fuzz.preparation import Arsenal
from evald_lab.fuzz.registration import register_mutated

__all__ = ["modules_step"]

_KLASS = "modules"


def modules_step(arsenal: Arsenal, rng: random.Random) -> None:
    """One batch (70%) or stream of module calls, maybe a registration after it."""
    ctx, profile = arsenal.ctx, arsenal.profile
    cheap = [m for m in arsenal.accepted if not m.heavy]
    heavy = [m for m in arsenal.accepted if m.heavy]
    picks = [rng.choice(cheap) for _ in range(profile.modules_items)] if cheap else []
    picks += [rng.choice(heavy) for _ in range(profile.modules_heavy)] if heavy else []
    items = [Item(m.name, m.draw_input(rng), m.family) for m in picks]
    results = ctx.send(_KLASS, ctx.attacker, items, via="stream" if rng.random() < 0.3 else "batch")
    for module, (_request, response) in zip(picks, results, strict=True):
        if response is not None:
            _check_outcome(ctx, module, response)
    if rng.random() < profile.registration_rate:
        register_mutated(ctx, rng, accepted=arsenal.accepted, refused=arsenal.refused)


def _check_outcome(
    ctx: FuzzContext, module: MaliciousModule, response: pb.EvaluateResponse
) -> None:
    outcome = outcome_label(response)
    # deadlines are wall-clock time: a machine that stalls the worker can end any call with
    # deadline_exceeded, so it is always allowed; a value from a loop never is
    if outcome not in module.expected and outcome != "deadline_exceeded":
        kind = "deadline_escape" if module.heavy and outcome == "ok" else "unexpected"
        ctx.recorder.add(
            [
                Violation(
                    kind,
                    _KLASS,
                    f"{module.family}: {outcome}, expected one of {sorted(module.expected)}",
                )
            ]
        )
    if module.probe == "previous_call" and outcome == "ok" and ctx.fresh:
        ctx.recorder.add(ctx.checker.nothing_survived(_KLASS, ctx.attacker, response.value))
    if module.probe == "memory_pages" and outcome == "ok":
        try:
            pages = int(response.value)
        except ValueError:
            ctx.recorder.add(
                [Violation("unexpected", _KLASS, f"memory probe said {response.value[:40]!r}")]
            )
        else:
            ctx.recorder.add(ctx.checker.memory_pages(_KLASS, ctx.attacker, pages))
