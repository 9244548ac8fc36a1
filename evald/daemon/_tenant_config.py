"""A tenant as the config and the fleet store describe it: its limits, its tokens' hashes, its
evaluators.

Why apart: a tenant is read from two places (a config's ``[[tenants]]`` table and a fleet
store's row, :func:`tenant_from_store`) and must be checked the same way in both, and its
limits' defaults have one home: the per-evaluation ones come from
:class:`evald.host.Limits` (``evald/host/_limits.py``), the rest are written here once.
Tokens are never stored: a tenant carries the hex SHA-256 of its tokens
(:func:`evald.contract.token_sha256`; ``evald hash-token`` makes one).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

from evald.contract import STANDARD_EVALUATORS
from evald.daemon._config_table import KIB, MIB, ConfigTable
from evald.daemon._store import is_sha256
from evald.host import Limits

__all__ = [
    "DEFAULT_MAX_MODULES",
    "TenantConfig",
    "TenantLimits",
    "is_tenant_name",
    "limits_from_table",
    "parse_limits",
    "tenant_from_store",
    "tenant_from_table",
]

#: The modules a tenant may register when its config or row does not say.
DEFAULT_MAX_MODULES: Final = 16

_TENANT_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")
_HASH_HELP = "expected 64 hex digits (the SHA-256 of the token; make one with `evald hash-token`)"

#: The one home of every per-evaluation default (``evald/host/_limits.py``); the limits below
#: take theirs from it, and tests check every shipped config against them.
_LIMITS = Limits()


def is_tenant_name(name: str) -> bool:
    """Whether ``name`` is a valid tenant name (``[a-z][a-z0-9_-]{0,63}``)."""
    return _TENANT_NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may use. Per evaluation: fuel, memory, deadline, input/output size; per
    tenant: evaluations in flight and the admission rate.

    ``max_concurrency`` counts evaluations admitted and not yet finished (queued or running);
    one more is refused with ``quota_exceeded`` instead of waiting, so a burst never queues without
    bound. ``rate_per_s`` is a token bucket of ``burst`` evaluations refilled at that rate;
    ``0`` turns the rate limit off. ``fuel = 0`` turns fuel metering off for this tenant (only the
    deadline then stops a loop). ``max_running`` caps the guest workers the tenant holds at once,
    so one tenant's slow work cannot take every worker from the others; its admitted items over
    the cap wait in the tenant's queue. ``0`` means ``max(1, threads - 1)``: with two or more
    workers one is always left for other tenants. ``max_calls`` counts the tenant's unary
    calls, streams and data-path connections; ``unread_bytes`` the output of its streams and
    connections that their clients have not read yet; ``request_bytes`` the request bytes the
    daemon holds for it (a data-path frame from its header on, a gRPC message once received)
    until the items in them are admitted: past it the daemon stops reading the tenant's streams
    and connections. ``instance_cache_bytes`` bounds the linear memory of the instances kept
    for reuse for the tenant, every worker together (``0``: none is kept; every call
    instantiates).
    """

    fuel: int = _LIMITS.fuel
    memory_bytes: int = _LIMITS.memory_bytes
    deadline_ms: int = _LIMITS.deadline_ms
    input_bytes: int = _LIMITS.input_bytes
    output_bytes: int = _LIMITS.output_bytes
    max_concurrency: int = 256
    rate_per_s: float = 0.0
    burst: int = 0
    max_running: int = 0
    max_calls: int = 256
    unread_bytes: int = 64 * MIB
    request_bytes: int = 64 * MIB
    instance_cache_bytes: int = _LIMITS.instance_cache_bytes

    def running_cap(self, threads: int, *, shared: bool = True) -> int:
        """Workers the tenant may hold at once on a pool of ``threads``.

        The default keeps one worker out of any single tenant's reach, so another tenant's call
        never waits behind a full deadline. A daemon serving one tenant (``shared=False``) has
        nobody to keep it for, and gives that tenant every worker.
        """
        if self.max_running > 0:
            return self.max_running
        return max(1, threads - 1) if shared else threads

    @property
    def effective_burst(self) -> int:
        """The bucket size: ``burst``, or one second's worth of the rate when ``burst`` is 0."""
        if self.burst > 0:
            return self.burst
        return max(1, math.ceil(self.rate_per_s))


@dataclass(frozen=True)
class TenantConfig:
    """One tenant: who it is (the hashes of its tokens, or none for the unix-socket-only
    tenant), its limits, which standard evaluators it may call and whether it may register its
    own.

    A tenant may hold several tokens at once, so a token rotates with no gap: the new token's
    hash is added, clients move to it, then the old hash is removed (``evald tenants rotate``
    and ``revoke``, or the config's ``token_sha256s`` and ``evald reload``). ``source`` says
    where the tenant is defined: ``config`` (this daemon's TOML) or ``store`` (the fleet store).
    """

    name: str
    token_sha256s: tuple[str, ...]
    limits: TenantLimits
    evaluators: tuple[str, ...] = ()
    allow_register: bool = False
    max_modules: int = DEFAULT_MAX_MODULES
    source: Literal["config", "store"] = "config"

    @property
    def tokenless(self) -> bool:
        """True for the tenant served without a token, and only on the unix socket."""
        return not self.token_sha256s and self.source == "config"

    def may_use_standard(self, name: str) -> bool:
        """Whether this tenant's ``evaluators`` list admits the standard evaluator ``name``."""
        return "*" in self.evaluators or name in self.evaluators


def limits_from_table(table: ConfigTable, base: TenantLimits) -> TenantLimits:
    """``base`` with the keys of a ``limits`` table applied, each checked.

    Raises:
        ConfigError: an unknown key or a bad value (the message names the key).
    """
    limits = TenantLimits(
        fuel=table.get_int("fuel", base.fuel),
        memory_bytes=table.get_size("memory_bytes", base.memory_bytes, minimum=64 * KIB),
        deadline_ms=table.get_int("deadline_ms", base.deadline_ms, minimum=1),
        input_bytes=table.get_size("input_bytes", base.input_bytes, minimum=1),
        output_bytes=table.get_size("output_bytes", base.output_bytes, minimum=1),
        max_concurrency=table.get_int("max_concurrency", base.max_concurrency, minimum=1),
        rate_per_s=table.get_float("rate_per_s", base.rate_per_s),
        burst=table.get_int("burst", base.burst),
        max_running=table.get_int("max_running", base.max_running),
        max_calls=table.get_int("max_calls", base.max_calls, minimum=1),
        unread_bytes=table.get_size("unread_bytes", base.unread_bytes, minimum=64 * KIB),
        request_bytes=table.get_size("request_bytes", base.request_bytes, minimum=64 * KIB),
        instance_cache_bytes=table.get_size(
            "instance_cache_bytes", base.instance_cache_bytes, minimum=0
        ),
    )
    table.finish()
    return limits


def tenant_from_table(table: ConfigTable, default_limits: TenantLimits) -> TenantConfig:
    """One ``[[tenants]]`` table (or a store row read as one), checked.

    Raises:
        ConfigError: a bad name, token hash, evaluator or limit (the message names the key).
    """
    name = table.get_str("name", "")
    if not is_tenant_name(name):
        raise table.error("name", f"expected a name matching [a-z][a-z0-9_-]{{0,63}}, got {name!r}")
    one = table.get_str("token_sha256", "").lower()
    hashes = tuple(value.lower() for value in table.get_str_list("token_sha256s", ()))
    if one and not is_sha256(one):
        raise table.error("token_sha256", _HASH_HELP)
    for value in hashes:
        if not is_sha256(value):
            raise table.error("token_sha256s", _HASH_HELP)
    evaluators = table.get_str_list("evaluators", ())
    for evaluator in evaluators:
        if evaluator != "*" and evaluator not in STANDARD_EVALUATORS:
            raise table.error(
                "evaluators",
                f"{evaluator!r} is not a standard evaluator "
                f'(expected "*" or some of: {", ".join(STANDARD_EVALUATORS)}); '
                "a tenant's own modules need not be listed",
            )
    tenant = TenantConfig(
        name=name,
        token_sha256s=tuple(dict.fromkeys((one, *hashes) if one else hashes)),
        limits=limits_from_table(table.get_table("limits"), default_limits),
        evaluators=evaluators,
        allow_register=table.get_bool("allow_register", False),
        max_modules=table.get_int("max_modules", DEFAULT_MAX_MODULES),
    )
    table.finish()
    return tenant


def tenant_from_store(
    document: Mapping[str, Any], default_limits: TenantLimits, source: str
) -> TenantConfig:
    """A fleet store's tenant row (name, token hashes, limits that differ from the defaults,
    evaluators, may-register, max modules), checked as a config's tenant is.

    Raises:
        ConfigError: a value of the wrong type or range (the message names ``source``).
    """
    table = ConfigTable(
        {
            "name": document.get("name", ""),
            "token_sha256s": list(document.get("token_sha256s") or []),
            "evaluators": list(document.get("evaluators") or []),
            "allow_register": bool(document.get("may_register", False)),
            "max_modules": document.get("max_modules", DEFAULT_MAX_MODULES),
            "limits": dict(document.get("limits") or {}),
        },
        "",
        source,
    )
    return replace(tenant_from_table(table, default_limits), source="store")


def parse_limits(overrides: Mapping[str, Any], base: TenantLimits, source: str) -> TenantLimits:
    """``base`` with ``overrides`` (``[tenants.limits]`` keys) applied, checked.

    Raises:
        ConfigError: an unknown key or a bad value (the message names ``source``).
    """
    return limits_from_table(ConfigTable(dict(overrides), "limits", source), base)
