"""Profiles and settings of a fuzz run, and the config of the daemon it starts for itself.

Two profiles: ``short`` (the ``make test`` run: every class, every check, both faults, about a
minute on two cores) and ``full`` (a million inputs; the committed report). They differ in the
budget, batch sizes and how many samples the noisy-neighbour measurement takes; the classes,
checks and scenarios are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from evald.daemon import hash_token
from evald_lab.fuzz.protocol.pools import (
    DATA_MAX_CONNECTIONS,
    DATA_UNAUTHENTICATED,
    FRAME_TIMEOUT_S,
    OPEN_CALLS,
)

__all__ = ["FULL", "PROFILES", "SHORT", "FuzzSettings", "Profile", "fuzz_config"]


@dataclass(frozen=True)
class Profile:
    """How much of each thing one run does.

    Attributes:
        count: the default input budget of the main loop (classes share it by ``shares``).
        shares: the fraction of inputs each class gets.
        lanes: steps in flight at once (client threads).
        generated_batch: items per generated step (one batch or one stream).
        corpus_light, corpus_heavy: attack-corpus items per step (heavy ones are large or run to
            the tenant's limits).
        modules_items, modules_heavy: malicious-module calls per step; heavy ones burn the whole
            fuel or deadline.
        registration_rate: the chance a modules step also registers a mutated module.
        noisy_samples: victim calls in each half of the noisy-neighbour measurement.
    """

    name: str
    count: int
    shares: dict[str, float]
    lanes: int
    generated_batch: int
    corpus_light: int
    corpus_heavy: int
    modules_items: int
    modules_heavy: int
    registration_rate: float
    noisy_samples: int


SHORT = Profile(
    name="short",
    count=24_000,
    shares={"generated": 0.55, "corpus": 0.25, "modules": 0.15, "protocol": 0.05},
    lanes=2,
    generated_batch=400,
    corpus_light=96,
    corpus_heavy=1,
    modules_items=48,
    modules_heavy=1,
    registration_rate=0.5,
    noisy_samples=200,
)

FULL = Profile(
    name="full",
    count=1_000_000,
    shares={"generated": 0.65, "corpus": 0.2, "modules": 0.1, "protocol": 0.05},
    lanes=2,
    generated_batch=2048,
    corpus_light=384,
    corpus_heavy=2,
    modules_items=256,
    modules_heavy=2,
    registration_rate=0.5,
    noisy_samples=1000,
)

PROFILES = {profile.name: profile for profile in (SHORT, FULL)}


@dataclass(frozen=True)
class FuzzSettings:
    """One run's settings (the ``evald fuzz`` command line)."""

    profile: Profile = SHORT
    count: int | None = None
    seconds: float | None = None
    seed: int = 0
    out_dir: Path | None = None
    target: str | None = None
    target_config: Path | None = None
    victim: str = "victim"
    attacker: str = "attacker"
    victim_token: str = ""
    attacker_token: str = ""
    target_pid: int | None = None
    threads: int = 2
    margin_ms: float = 250.0
    rss_bound_bytes: int = 1024 * 2**20
    faults: bool = True
    progress: bool = True
    noisy_attackers: int = 0
    work_dir: Path | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def budget(self) -> str:
        if self.seconds is not None:
            return f"{self.seconds:g} s"
        return f"{self.input_budget} inputs"

    @property
    def input_budget(self) -> int:
        return self.count if self.count is not None else self.profile.count


def fuzz_config(
    *,
    victim_token: str,
    attacker_token: str,
    threads: int,
    metrics_port: int,
    data_listen: str = "",
) -> str:
    """The daemon config for a run: two tenants, a victim and an attacker.

    Both may use every standard evaluator and register modules. The attacker's limits are tight
    (its calls end fast, so the run can make many), the victim's are the defaults scaled down.
    ``max_concurrency`` is high enough for the largest batch; the noisy-neighbour measurement
    decides what concurrency costs the victim. ``data_listen`` opens the engine data path,
    which the data-path scenarios attack like the gRPC surface.
    """
    return "\n".join(
        [
            "[server]",
            f"threads = {threads}",
            *([f'data_listen = "{data_listen}"'] if data_listen else []),
            f'metrics_listen = "127.0.0.1:{metrics_port}"',
            "max_batch_items = 4096",
            'max_message_bytes = "8MiB"',
            # What the pools scenarios expect (evald_lab.fuzz.protocol.pools).
            f"open_calls = {OPEN_CALLS}",
            f"data_max_connections = {DATA_MAX_CONNECTIONS}",
            f"data_unauthenticated_connections = {DATA_UNAUTHENTICATED}",
            f"frame_timeout_s = {FRAME_TIMEOUT_S}",
            'log_level = "warning"',
            "shutdown_grace_s = 10",
            # low enough that a module inside the compile-cost caps can pass it (a refused row)
            'compile_memory_bytes = "128MiB"',
            "[host]",
            'module_bytes = "4MiB"',
            "[[tenants]]",
            'name = "victim"',
            f'token_sha256 = "{hash_token(victim_token)}"',
            'evaluators = ["*"]',
            "allow_register = true",
            "max_modules = 16",
            "[tenants.limits]",
            "fuel = 100000000",
            'memory_bytes = "32MiB"',
            "deadline_ms = 50",
            'input_bytes = "1MiB"',
            'output_bytes = "64KiB"',
            "max_concurrency = 20000",
            "[[tenants]]",
            'name = "attacker"',
            f'token_sha256 = "{hash_token(attacker_token)}"',
            'evaluators = ["*"]',
            "allow_register = true",
            "max_modules = 64",
            "[tenants.limits]",
            "fuel = 20000000",
            'memory_bytes = "8MiB"',
            "deadline_ms = 20",
            'input_bytes = "1MiB"',
            'output_bytes = "4KiB"',
            "max_concurrency = 20000",
        ]
    )
