"""The ``protocol`` class: one step is one scenario of :data:`evald_lab.fuzz.protocol.SCENARIOS`,
drawn by its weight (the scenarios check and record what they send themselves)."""

from __future__ import annotations

import random

from evald_lab.fuzz import protocol
from evald_lab.fuzz.preparation import Arsenal

__all__ = ["protocol_step"]


def protocol_step(arsenal: Arsenal, rng: random.Random) -> None:
    """Runs one weighted draw of the protocol scenarios."""
    names = [s[0] for s in protocol.SCENARIOS]
    weights = [s[2] for s in protocol.SCENARIOS]
    index = rng.choices(range(len(names)), weights=weights)[0]
    protocol.SCENARIOS[index][1](arsenal.ctx, rng)
