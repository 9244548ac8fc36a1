"""The main loop's four classes of steps, one module each.

A step is one batch or stream (or one protocol scenario) of its class, drawn from its own
``random.Random``: :mod:`.generated_inputs` (the evaluators' grammars and mutations of them),
:mod:`.attack_corpus` (the per-evaluator attack corpus), :mod:`.malicious_modules` (calls of the
attacker's modules, registrations of mutated ones) and :mod:`.protocol_abuse` (one gRPC or
data-path abuse scenario). :data:`STEPS` maps each class to its step, in the order the report
lists them.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from evald_lab.fuzz.preparation import Arsenal
from evald_lab.fuzz.steps.attack_corpus import corpus_step
from evald_lab.fuzz.steps.generated_inputs import generated_step
from evald_lab.fuzz.steps.malicious_modules import modules_step
from evald_lab.fuzz.steps.protocol_abuse import protocol_step

__all__ = ["CLASSES", "STEPS", "Step"]

#: One step of a class: what the set-up prepared, and the step's own generator.
Step = Callable[[Arsenal, random.Random], None]

STEPS: dict[str, Step] = {
    "generated": generated_step,
    "corpus": corpus_step,
    "modules": modules_step,
    "protocol": protocol_step,
}

#: The main loop's classes (each has a share of the budget in the profile).
CLASSES = tuple(STEPS)
