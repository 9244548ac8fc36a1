"""How a request's tenant options are read, kept and kept apart in SGLang's grammar cache."""

from __future__ import annotations

import pytest

from engine_adapter._server_config import AdapterConfig
from engine_adapter._server_runtime import TenantRuntimes
from engine_adapter.sglang._tenants import TENANT_MARK, TenantTable, split_key, take_options


def test_options_leave_custom_params() -> None:
    options, rest = take_options({"evald_token": "t", "thinking_budget": 5})
    assert options == {"evald_token": "t"} and rest == {"thinking_budget": 5}
    options, rest = take_options({"evald_token": "t", "evald_target": "h:1"})
    assert options == {"evald_token": "t", "evald_target": "h:1"} and rest is None
    assert take_options({"thinking_budget": 5}) == (None, {"thinking_budget": 5})
    assert take_options(None) == (None, None)


def test_the_key_holds_a_fingerprint_never_the_token() -> None:
    table = TenantTable()
    one = table.fingerprint({"evald_token": "secret-token-a"})
    two = table.fingerprint({"evald_token": "secret-token-b"})
    assert one != two and "secret" not in one + two
    assert table.fingerprint({"evald_token": "secret-token-a"}) == one
    assert TenantTable().fingerprint({"evald_token": "secret-token-a"}) != one  # salted
    assert table.options(one) == {"evald_token": "secret-token-a"}
    key = '{"type": "structural_tag"}' + TENANT_MARK + one
    assert split_key(key) == ('{"type": "structural_tag"}', one)
    assert split_key('{"type": "structural_tag"}') == ('{"type": "structural_tag"}', None)


def test_the_table_forgets_the_oldest() -> None:
    table = TenantTable(size=2)
    first = table.fingerprint({"evald_token": "a"})
    table.fingerprint({"evald_token": "b"})
    table.fingerprint({"evald_token": "c"})
    assert table.options(first) is None


@pytest.mark.parametrize("limit", [1, 3])
def test_tenant_runtimes_are_capped(limit: int) -> None:
    from engine_adapter import TokenCodec

    codec = TokenCodec([b"a", b"b"])
    tenants = TenantRuntimes(codec, limit=limit)
    base = AdapterConfig("unix:/nowhere")
    made = [tenants.get(AdapterConfig(base.target, f"token-{i}")) for i in range(limit)]
    assert all(made) and len(tenants) == limit
    assert tenants.get(AdapterConfig(base.target, "token-0")) is made[0]
    assert tenants.get(AdapterConfig(base.target, "one-more")) is None
    refusing = tenants.refusing(base, "quota_exceeded", "too many")
    future = refusing.submit("calc", "1 + 1", 100)
    assert future.result().error_code == "quota_exceeded" and len(tenants) == limit
