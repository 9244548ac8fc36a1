"""The real-server harnesses' shared runs (``engine_adapter.testing._server_runs``): the daemon
configs both harnesses start evald with are read by evald's own config parser, with the tenants
the real-server tests name, and each engine's venv is found where the Makefile builds it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from engine_adapter.testing import CpuPartition, sglang, vllm
from engine_adapter.testing._server_runs import (
    SLOW_TENANT_DEADLINE_MS,
    SPIN_TENANT_DEADLINE_MS,
    venv_python,
)
from evald.daemon import TenantConfig, hash_token, parse_config, parse_cpu_list


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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a partition needs two CPUs or more")
@pytest.mark.parametrize("harness", [sglang, vllm])
def test_a_partition_gives_evald_the_last_cpu_and_the_engine_the_others(harness: Any) -> None:
    """The engine's CPUs and evald's do not meet and cover the CPUs this process may use; the
    daemon config the harness starts evald with reads back with evald's CPUs, and the engine's
    settings name the engine's (the real servers run them: the stall benchmark's partitioned
    runs, docs/sglang.md)."""
    available = sorted(os.sched_getaffinity(0))
    partition = CpuPartition.split()
    engine = parse_cpu_list(partition.engine)
    assert parse_cpu_list(partition.evald) == {available[-1]}
    assert engine == set(available[:-1])
    server = parse_config(partition.daemon_config(harness.CONFIG), "harness").server
    assert server.cpus == {available[-1]} and server.threads == 2
    assert partition.engine_prefix() == ["taskset", "-c", partition.engine]
    env = partition.engine_env("SGLANG_CPU_OMP_THREADS_BIND")
    assert parse_cpu_list(env["SGLANG_CPU_OMP_THREADS_BIND"]) == engine
    assert env["OMP_NUM_THREADS"] == str(len(engine))
    wide = CpuPartition("0-13,16", "14-15").engine_env("VLLM_CPU_OMP_THREADS_BIND")
    assert wide == {"VLLM_CPU_OMP_THREADS_BIND": "0-13,16", "OMP_NUM_THREADS": "15"}
    with pytest.raises(ValueError, match="cannot give evald"):
        CpuPartition.split(len(available))
