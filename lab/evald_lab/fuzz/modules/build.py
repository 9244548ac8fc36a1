"""What a malicious module is, and the small builders the module tables are written in.

The tables (:mod:`.refused`, :mod:`.accepted`) are data: one row per attack, naming its label,
its family, how to build its bytes and what the daemon must do with it. A row is turned into a
:class:`MaliciousModule` only once a run knows what some attacks are sized against (the
attacker's limits, the host's module cap, the victim's module name): :class:`AttackParams`.
Modules are built with wasmtime's WAT compiler and :mod:`evald.testing`, the same
generator the host tests use.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import wasmtime

from evald.contract import MANIFEST_SECTION, append_custom_section
from evald.testing import guest, manifest_bytes, wat_text

__all__ = [
    "AttackParams",
    "Builder",
    "Draw",
    "MaliciousModule",
    "ModuleRow",
    "Naming",
    "echo_with_getter",
    "fixed",
    "from_wat",
    "module_manifest",
    "one_of",
    "with_behaviour",
]

#: How a row's module is named: ``prefixed`` (the run's prefix and the label, so names are unique
#: per run), ``exact`` (the label itself: names the daemon must refuse as such), ``victims`` (the
#: victim's module name: the attacker registers its own module under it).
Naming = Literal["prefixed", "exact", "victims"]


@dataclass(frozen=True)
class MaliciousModule:
    """One uploaded module and what the daemon must do with it.

    Attributes:
        name: the manifest name (also the tag).
        family: the attack it represents.
        wasm: the module bytes.
        refusal: when set, registration must fail with one of these codes.
        expected: for an accepted module, the outcomes a call may have.
        draw_input: the input of one call.
        heavy: each call burns the tenant's whole fuel or deadline.
        probe: ``memory_pages`` when the value is the guest's page count (checked against the
            memory limit); ``previous_call`` when it is what an earlier call left (nothing,
            under fresh isolation).
    """

    name: str
    family: str
    wasm: bytes
    refusal: frozenset[str] = frozenset()
    expected: frozenset[str] = frozenset()
    draw_input: Callable[[random.Random], bytes] = lambda _rng: b"x"
    heavy: bool = False
    probe: str = ""


@dataclass(frozen=True)
class AttackParams:
    """What some attacks are sized against, known once the run has read the daemon's config.

    Attributes:
        prefix: put before every prefixed name (unique per run, so reruns do not collide).
        memory_bytes: the attacker's memory limit (a module's minimum memory above it).
        module_bytes: the host's module cap (a module one byte over it).
        output_bytes: the attacker's output limit (values around it).
        shadow_name: the victim's module name (the attacker's own module under it).
    """

    prefix: str
    memory_bytes: int = 0
    module_bytes: int = 0
    output_bytes: int = 0
    shadow_name: str = ""

    def name(self, label: str, naming: Naming) -> str:
        """The module name of a row labelled ``label`` (manifest names are at most 32 bytes)."""
        if naming == "exact":
            return label
        if naming == "victims":
            return self.shadow_name
        return f"{self.prefix}{label}"[:32]


#: A row's module bytes, given the module's name and the run's parameters.
Builder = Callable[[str, AttackParams], bytes]
#: A row's call input, drawn from the step's generator.
Draw = Callable[[random.Random, AttackParams], bytes]


def _one_x(_rng: random.Random, _params: AttackParams) -> bytes:
    return b"x"


@dataclass(frozen=True)
class ModuleRow:
    """One attack in a module table; :meth:`module` builds it for a run.

    Attributes:
        label: the name's label (see :data:`Naming`).
        family: the attack it represents (the report's family).
        build: the module bytes.
        refusal: for a module registration must refuse, the codes it may refuse with.
        expected: for a module that registers, the outcomes a call may have.
        draw: a call's input (a module that registers).
        heavy: each call burns the tenant's whole fuel or deadline.
        probe: see :attr:`MaliciousModule.probe`.
        naming: how the module is named.
    """

    label: str
    family: str
    build: Builder
    refusal: frozenset[str] = frozenset()
    expected: frozenset[str] = frozenset()
    draw: Draw = _one_x
    heavy: bool = False
    probe: str = ""
    naming: Naming = "prefixed"

    def module(self, params: AttackParams) -> MaliciousModule:
        name = params.name(self.label, self.naming)
        draw = self.draw
        return MaliciousModule(
            name=name,
            family=self.family,
            wasm=self.build(name, params),
            refusal=self.refusal,
            expected=self.expected,
            draw_input=lambda rng: draw(rng, params),
            heavy=self.heavy,
            probe=self.probe,
        )


def module_manifest(name: str, **changes: object) -> bytes:
    """The manifest of a module named ``name`` (its tag too), with ``changes`` applied."""
    return manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1", **changes)


def with_behaviour(kind: str = "echo", param: object = None, **options: Any) -> Builder:
    """A :func:`~evald.testing.guest` of behaviour ``kind`` under the row's name."""

    def build(name: str, _params: AttackParams) -> bytes:
        return guest(kind, param, manifest=module_manifest(name), **options)

    return build


def from_wat(name: str, wat: str) -> bytes:
    """``wat`` compiled, with the manifest of a module named ``name``."""
    wasm = bytes(wasmtime.wat2wasm(wat))
    return append_custom_section(wasm, MANIFEST_SECTION, module_manifest(name))


def echo_with_getter(export: str, value: int) -> Builder:
    """An echo module whose buffer getter ``export`` returns ``value`` (an i32)."""

    def build(name: str, _params: AttackParams) -> bytes:
        wat = wat_text("echo")
        marker = f'(func (export "{export}") (result i32) (i32.const '
        start = wat.index(marker) + len(marker)
        end = wat.index(")", start)
        return from_wat(name, wat[:start] + str(value) + wat[end:])

    return build


def fixed(data: bytes) -> Draw:
    """Always ``data`` (draws nothing from the generator)."""
    return lambda _rng, _params: data


def one_of(*choices: bytes) -> Draw:
    """One of ``choices``, drawn from the generator."""
    return lambda rng, _params: rng.choice(choices)
