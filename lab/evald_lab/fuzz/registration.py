"""The attacker's registrations and what each must come to: the one place that judges them.

A module of the registered-then-misbehaving table must register (a refusal is a finding: the
validator is stricter than the ABI); one of the refused table must be refused with its codes,
and the refusal's message must not carry the other tenant's secrets; mutated module bytes may be
refused as invalid or registered, never anything else. Every registration is one input of the
``modules`` class.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable

from evald.client import CallError
from evald_lab.fuzz.checks import Violation
from evald_lab.fuzz.context import FuzzContext
from evald_lab.fuzz.modules import MaliciousModule, mutated_module

__all__ = ["register_accepted", "register_mutated", "register_refused"]

_KLASS = "modules"


def _code(error: CallError) -> str | None:
    return error.code.value if error.code is not None else None


def register_accepted(
    ctx: FuzzContext, modules: Iterable[MaliciousModule]
) -> list[MaliciousModule]:
    """Registers ``modules`` as the attacker; returns those that registered."""
    client = ctx.client(ctx.attacker)
    registered: list[MaliciousModule] = []
    for module in modules:
        try:
            client.register(module.wasm, replace=True)
        except CallError as error:
            ctx.recorder.outcome(
                _KLASS, f"call:{_code(error) or 'unreachable'}", family=f"register:{module.family}"
            )
            ctx.recorder.add(
                [
                    Violation(
                        "unexpected",
                        _KLASS,
                        f"{module.family} was refused: {error.message[:160]}",
                    )
                ]
            )
            continue
        ctx.recorder.outcome(_KLASS, "registered", family=f"register:{module.family}")
        registered.append(module)
    return registered


def register_refused(ctx: FuzzContext, module: MaliciousModule, rng: random.Random) -> None:
    """Tries to register ``module`` (half the time as a replacement); it must be refused."""
    try:
        ctx.client(ctx.attacker).register(module.wasm, replace=rng.random() < 0.5)
    except CallError as error:
        code = _code(error)
        ctx.recorder.outcome(
            _KLASS, f"call:{code or 'unreachable'}", family=f"register:{module.family}"
        )
        ctx.recorder.add(
            ctx.checker.call_error(_KLASS, code, error.message, expected=module.refusal)
        )
        ctx.recorder.add(ctx.checker.text(_KLASS, ctx.attacker, error.message))
        return
    ctx.recorder.outcome(_KLASS, "registered", family=f"register:{module.family}")
    ctx.recorder.add(
        [Violation("unexpected", _KLASS, f"{module.family}: a malicious module was registered")]
    )
    with contextlib.suppress(CallError):
        ctx.client(ctx.attacker).delete(module.name)


def register_mutated(
    ctx: FuzzContext,
    rng: random.Random,
    *,
    accepted: list[MaliciousModule],
    refused: list[MaliciousModule],
) -> None:
    """One registration attempt: a refused module again (30%), or a mutated small accepted one
    (deleted again when it registered under a new name, so the tenant's quota lasts the run)."""
    client = ctx.client(ctx.attacker)
    if refused and rng.random() < 0.3:
        register_refused(ctx, rng.choice(refused), rng)
        return
    bases = [m for m in accepted if len(m.wasm) < 64 * 1024]
    if not bases:
        return
    base = rng.choice(bases)
    wasm = mutated_module(base.wasm, rng)
    try:
        info = client.register(wasm)
    except CallError as error:
        code = _code(error)
        ctx.recorder.outcome(_KLASS, f"call:{code or 'unreachable'}", family="register:mutated")
        ctx.recorder.add(
            ctx.checker.call_error(
                _KLASS, code, error.message, expected=("invalid_module", "invalid_argument")
            )
        )
        return
    ctx.recorder.outcome(_KLASS, "registered", family="register:mutated")
    if info.name not in {m.name for m in accepted}:
        with contextlib.suppress(CallError):
            client.delete(info.name)
