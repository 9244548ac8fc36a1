"""The real-server harnesses' shared runs (``engine_adapter.testing._server_runs``): the daemon
configs both harnesses start evald with are read by evald's own config parser, with the tenants
the real-server tests name, and each engine's venv is found where the Makefile builds it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_adapter.testing import sglang, vllm
from engine_adapter.testing._server_runs import (
    SLOW_TENANT_DEADLINE_MS,
    SPIN_TENANT_DEADLINE_MS,
    venv_python,
)
from evald.daemon import TenantConfig, hash_token, parse_config


def _tenants(config: str) -> dict[str, TenantConfig]:
    return {tenant.name: tenant for tenant in parse_config(config, "harness").tenants}


@pytest.mark.parametrize(
    ("harness", "tokens", "registering"),
    [
        (
            sglang,
            {
                "sglang": sglang.TOKEN,
                "other": sglang.OTHER_TOKEN,
                "spin": sglang.SPIN_TOKEN,
                "slow": sglang.SLOW_TOKEN,
            },
            {"sglang", "spin", "slow"},
        ),
        (
            vllm,
            {"vllm": vllm.TOKEN, "spin": vllm.SPIN_TOKEN, "slow": vllm.SLOW_TOKEN},
            {"spin", "slow"},
        ),
    ],
    ids=["sglang", "vllm"],
)
def test_each_harness_config_holds_the_tenants_its_tests_name(
    harness: object, tokens: dict[str, str], registering: set[str]
) -> None:
    tenants = _tenants(harness.CONFIG)  # type: ignore[attr-defined]
    assert set(tenants) == {"local", *tokens}
    assert tenants["local"].tokenless
    for name, token in tokens.items():
        assert tenants[name].token_sha256s == (hash_token(token),), name
        assert tenants[name].evaluators == ("*",), name
    assert {name for name, tenant in tenants.items() if tenant.allow_register} == registering
    # The spinning tenant's spans last the adapter's whole deadline; the slow one's stay inside.
    assert tenants["spin"].limits.deadline_ms == SPIN_TENANT_DEADLINE_MS
    assert tenants["slow"].limits.deadline_ms == SLOW_TENANT_DEADLINE_MS
    assert tenants["spin"].limits.fuel == tenants["slow"].limits.fuel == 0
    assert SLOW_TENANT_DEADLINE_MS < harness.DEADLINE_MS < SPIN_TENANT_DEADLINE_MS  # type: ignore[attr-defined]


def test_the_venv_python_comes_from_the_variable_then_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EVALD_SGLANG_PYTHON", raising=False)
    monkeypatch.delenv("EVALD_VLLM_PYTHON", raising=False)
    assert sglang.sglang_python(tmp_path) is None and vllm.vllm_python(tmp_path) is None
    built = tmp_path / ".venv-vllm" / "bin" / "python"
    built.parent.mkdir(parents=True)
    built.touch()
    assert vllm.vllm_python(tmp_path) == built
    assert sglang.sglang_python(tmp_path) is None
    named = tmp_path / "elsewhere-python"
    named.touch()
    monkeypatch.setenv("EVALD_SGLANG_PYTHON", str(named))
    assert sglang.sglang_python(tmp_path) == named
    monkeypatch.setenv("EVALD_SGLANG_PYTHON", str(tmp_path / "missing"))
    assert venv_python("EVALD_SGLANG_PYTHON", ".venv-sglang", tmp_path) is None
