"""The ``corpus`` class: one step sends the attacker's draw from one evaluator's attack corpus
(:mod:`evald_lab.fuzz.corpus`), mostly light attacks and a few heavy ones that run to the
tenant's limits."""

from __future__ import annotations

import random

from evald.contract import STANDARD_EVALUATORS
from evald_lab.fuzz.context import Item
from evald_lab.fuzz.corpus import attacks_for
from evald_lab.fuzz.preparation import Arsenal

__all__ = ["corpus_step"]


def corpus_step(arsenal: Arsenal, rng: random.Random) -> None:
    """One batch (70%) or stream of one evaluator's attacks, as the attacker."""
    ctx, profile = arsenal.ctx, arsenal.profile
    evaluator = rng.choice(sorted(arsenal.generators) or list(STANDARD_EVALUATORS))
    attacks = attacks_for(evaluator)
    light = [a for a in attacks if not a.heavy]
    heavy = [a for a in attacks if a.heavy]
    picks = [rng.choice(light) for _ in range(profile.corpus_light)]
    picks += [rng.choice(heavy) for _ in range(profile.corpus_heavy)]
    items = [Item(evaluator, attack.draw(rng), f"{evaluator}:{attack.family}") for attack in picks]
    ctx.send("corpus", ctx.attacker, items, via="stream" if rng.random() < 0.3 else "batch")
