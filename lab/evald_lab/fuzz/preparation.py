"""The run's set-up: the shared context, the evaluators' grammars, the tenants' modules.

Order matters and is part of the run: the context and its canaries first; then the standard
evaluators as the daemon lists them (a generator per input grammar, each result regex for the
checker); then the victim's canary modules (registered before anything else, so they persist
through the kill -9 fault); then the attacker's modules (those that must register, then those
that must be refused). What the main loop needs afterwards is an :class:`Arsenal`.
"""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass

from evald.daemon import Config
from evald.testing import guest, manifest_bytes
from evald_lab.fuzz.checks import Canaries, Checker, TenantBounds, Violation
from evald_lab.fuzz.context import FuzzContext
from evald_lab.fuzz.daemon_under_test import DaemonUnderTest
from evald_lab.fuzz.generate import GrammarError, GrammarGenerator
from evald_lab.fuzz.modules import MaliciousModule, accepted_modules, refused_modules
from evald_lab.fuzz.registration import register_accepted, register_refused
from evald_lab.fuzz.settings import FuzzSettings, Profile
from evald_lab.fuzz.tally import Recorder

__all__ = ["Arsenal", "new_context", "prepare", "tenant_bounds"]


@dataclass(frozen=True)
class Arsenal:
    """What the set-up leaves the main loop's steps.

    Attributes:
        ctx: the shared context (target, tenants, checker, tally).
        profile: how much each step does.
        generators: a grammar generator per standard evaluator the daemon listed.
        accepted: the attacker's modules that registered (called by the modules step).
        refused: the modules registration must refuse (tried again by the modules step).
    """

    ctx: FuzzContext
    profile: Profile
    generators: dict[str, GrammarGenerator]
    accepted: list[MaliciousModule]
    refused: list[MaliciousModule]


def tenant_bounds(config: Config) -> dict[str, TenantBounds]:
    """Each tenant's limits, as the checks hold the daemon to them."""
    return {
        tenant.name: TenantBounds(
            name=tenant.name,
            fuel=tenant.limits.fuel,
            deadline_ms=tenant.limits.deadline_ms,
            memory_bytes=tenant.limits.memory_bytes,
            input_bytes=tenant.limits.input_bytes,
            output_bytes=tenant.limits.output_bytes,
        )
        for tenant in config.tenants
    }


def new_context(settings: FuzzSettings, daemon: DaemonUnderTest, recorder: Recorder) -> FuzzContext:
    """The shared context, with the run's canaries and the names made from its tag.

    Raises:
        ValueError: the daemon's config lacks the victim or the attacker tenant.
    """
    bounds = tenant_bounds(daemon.config)
    victim, attacker = daemon.victim, daemon.attacker
    for name in (victim, attacker):
        if name not in bounds:
            raise ValueError(f"the daemon's config has no tenant {name!r}")
    tokens = daemon.tokens
    canaries = Canaries()
    tag = _run_tag(settings)
    victim_canary = f"CANARY-V-{secrets.token_hex(12)}"
    attacker_canary = f"CANARY-A-{secrets.token_hex(12)}"
    canaries.add(victim, tokens[victim], victim_canary, f"v_secret_{tag}")
    canaries.add(attacker, tokens[attacker], attacker_canary)
    server = daemon.config.server
    ctx = FuzzContext(
        target=daemon.target,
        tokens=tokens,
        victim=victim,
        attacker=attacker,
        bounds=bounds,
        checker=Checker(bounds, canaries, margin_ms=settings.margin_ms),
        recorder=recorder,
        canaries=canaries,
        threads=daemon.threads,
        max_batch_items=server.max_batch_items,
        max_message_bytes=server.max_message_bytes,
        margin_ms=settings.margin_ms,
        metrics_port=daemon.metrics_port,
        data_target=server.data_listen or None,
        fresh=daemon.config.host.isolation == "fresh",
    )
    ctx.secrets.victim_echo = f"v_echo_{tag}"
    ctx.secrets.victim_secret = f"v_secret_{tag}"
    ctx.secrets.victim_canary = victim_canary
    ctx.secrets.attacker_canary = attacker_canary
    return ctx


def prepare(settings: FuzzSettings, ctx: FuzzContext, config: Config) -> Arsenal:
    """Reads the evaluators and registers the tenants' modules (in the module docstring's
    order) on the daemon whose config is ``config``."""
    generators = _read_evaluators(ctx)
    _register_victim_canaries(ctx)
    accepted, refused = _register_attacker_modules(settings, ctx, config)
    return Arsenal(ctx, settings.profile, generators, accepted, refused)


def _run_tag(settings: FuzzSettings) -> str:
    """The tag the run's module names are made from: drawn from the seed, so the names are the
    same every run of a seed (canaries, by contrast, are fresh secrets)."""
    return f"{random.Random(f'{settings.seed}:setup').getrandbits(40):010x}"


def _read_evaluators(ctx: FuzzContext) -> dict[str, GrammarGenerator]:
    """The standard evaluators as the daemon lists them: each result regex goes to the checker,
    each input grammar to a generator (an unreadable grammar is a finding)."""
    generators: dict[str, GrammarGenerator] = {}
    for info in ctx.client(ctx.attacker).list_evaluators():
        if info.owner != "standard":
            continue
        ctx.evaluators[info.name] = info
        ctx.checker.set_result_regex(info.name, info.result_regex)
        try:
            generators[info.name] = GrammarGenerator(info.input_grammar)
        except GrammarError as error:
            ctx.recorder.add(
                [Violation("unexpected", "generated", f"{info.name}: unreadable grammar: {error}")]
            )
    return generators


def _register_victim_canaries(ctx: FuzzContext) -> None:
    """The victim's echo and secret modules: names the attacker must never see or reach."""
    client = ctx.client(ctx.victim)
    for name in (ctx.secrets.victim_echo, ctx.secrets.victim_secret):
        manifest = manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1")
        client.register(guest("echo", manifest=manifest), replace=True)


def _register_attacker_modules(
    settings: FuzzSettings, ctx: FuzzContext, config: Config
) -> tuple[list[MaliciousModule], list[MaliciousModule]]:
    """Registers the attacker's modules; returns (those that registered, those to refuse)."""
    prefix = f"m{_run_tag(settings)[:4]}_"
    attacker_bounds = ctx.bounds[ctx.attacker]
    refused = refused_modules(
        prefix, memory_bytes=attacker_bounds.memory_bytes, module_bytes=config.host.module_bytes
    )
    accepted = register_accepted(
        ctx,
        accepted_modules(
            prefix, output_bytes=attacker_bounds.output_bytes, shadow_name=ctx.secrets.victim_echo
        ),
    )
    for module in accepted:
        if module.family == "infinite_loop_in_eval":
            ctx.secrets.attacker_loop = module.name
    for module in refused:
        register_refused(ctx, module, random.Random(f"{settings.seed}:refused:{module.name}"))
    return accepted, refused
