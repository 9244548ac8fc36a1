"""Which of the fleet store's tenants a daemon serves beside its config's own, and why not the
others.

Why a rule of its own: the store's tenant rows come from operators' logins (and anyone who
writes the database), the config's from the machine's owner. A store row must never take over
what the config already gives out: a store tenant with a config tenant's name is not served
(the config's is), and neither is one that holds a config tenant's token, or a token another
store tenant holds too (else whichever came last in the token index would answer for it, and
a config tenant's calls would run as the store's, silently). And a row that does not convert
(any exception at all, a ``RecursionError`` on absurd nesting included) costs only its own
tenant: it is refused and logged, and every other tenant is still applied.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from evald.daemon._config import TenantConfig, TenantLimits, tenant_from_store

__all__ = ["Refusal", "StoreTenants", "log_refusals", "store_tenants"]

_log = logging.getLogger("evald.store")


@dataclass(frozen=True)
class Refusal:
    """A store tenant this daemon does not serve, and why (logged once per reason)."""

    tenant: str
    reason: str
    config_tenant: str | None = None


@dataclass
class StoreTenants:
    """The result: the tenants to serve (config first) and the store rows refused."""

    served: dict[str, TenantConfig] = field(default_factory=dict)
    refused: list[Refusal] = field(default_factory=list)


def _converted(
    rows: Mapping[str, Mapping[str, Any]], defaults: TenantLimits
) -> tuple[dict[str, TenantConfig], list[Refusal]]:
    converted: dict[str, TenantConfig] = {}
    refused: list[Refusal] = []
    for name, row in sorted(rows.items()):
        try:
            converted[name] = tenant_from_store(row, defaults, f"fleet store tenant {name!r}")
        except Exception as exc:  # any failure is this row's (RecursionError included)
            text = str(exc) if not isinstance(exc, RecursionError) else "nested too deep"
            refused.append(Refusal(name, f"its row does not convert: {text[:300]}"))
    return converted, refused


def store_tenants(
    local: Iterable[TenantConfig],
    rows: Mapping[str, Mapping[str, Any]],
    defaults: TenantLimits,
) -> StoreTenants:
    """The config's tenants (``local``) and the store's ``rows`` that may be served beside
    them (see the module)."""
    result = StoreTenants(served={tenant.name: tenant for tenant in local})
    config_tokens = {
        digest: tenant.name for tenant in result.served.values() for digest in tenant.token_sha256s
    }
    converted, result.refused = _converted(rows, defaults)
    holders: dict[str, list[str]] = {}
    for name, tenant in converted.items():
        for digest in set(tenant.token_sha256s):
            holders.setdefault(digest, []).append(name)
    for name, tenant in converted.items():
        if name in result.served:
            result.refused.append(
                Refusal(name, "a tenant of this daemon's config has its name", config_tenant=name)
            )
            continue
        owner = next((config_tokens[d] for d in tenant.token_sha256s if d in config_tokens), None)
        if owner is not None:
            result.refused.append(
                Refusal(name, "it holds the token of a tenant of this daemon's config", owner)
            )
            continue
        shared = sorted({o for d in tenant.token_sha256s for o in holders[d] if o != name})
        if shared:
            result.refused.append(
                Refusal(name, f"it holds a token of store tenant(s) {', '.join(shared)} too")
            )
            continue
        result.served[name] = tenant
    return result


def log_refusals(refused: Iterable[Refusal], logged: set[Refusal]) -> None:
    """Logs each refusal once (the same one at the next revision is not logged again)."""
    for refusal in refused:
        if refusal in logged:
            continue
        logged.add(refusal)
        fields: dict[str, Any] = {"tenant": refusal.tenant, "reason": refusal.reason}
        if refusal.config_tenant is not None:
            fields["config_tenant"] = refusal.config_tenant
        _log.error("fleet store tenant not served", extra={"fields": fields})
