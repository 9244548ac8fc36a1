"""Which store tenants a daemon serves beside its config's (``_fleet_tenants``): a row that does
not convert, or that would take a token someone else holds, costs only its own tenant."""

from __future__ import annotations

from typing import Any

from evald.daemon import TenantLimits, hash_token, parse_config
from evald.daemon._fleet_tenants import store_tenants

CONFIG = parse_config(
    f'[[tenants]]\nname = "alpha"\ntoken_sha256 = "{hash_token("alpha-token")}"\n', "test"
)


def _row(name: str, token: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "token_sha256s": [hash_token(token)], "evaluators": ["*"], **extra}


def _deep(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"deadline_ms": value}
    return value


def test_each_refused_row_costs_only_its_tenant() -> None:
    rows = {
        "good": _row("good", "good-token"),
        "deep": _row("deep", "deep-token", limits=_deep(3000)),
        "thief": _row("thief", "alpha-token"),
        "alpha": _row("alpha", "other-token"),
        "twin1": _row("twin1", "shared-token"),
        "twin2": _row("twin2", "shared-token"),
    }
    result = store_tenants(CONFIG.tenants, rows, TenantLimits())
    assert sorted(result.served) == ["alpha", "good"]
    assert result.served["alpha"].source == "config"  # the config's keeps its name
    why = {refusal.tenant: refusal for refusal in result.refused}
    assert sorted(why) == ["alpha", "deep", "thief", "twin1", "twin2"]
    assert "does not convert" in why["deep"].reason
    assert why["thief"].config_tenant == "alpha" and "token" in why["thief"].reason
    assert "twin2" in why["twin1"].reason and "twin1" in why["twin2"].reason
