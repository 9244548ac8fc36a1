"""Contracts no other test pins: the wire numbers of the error codes, and the limit defaults.

The error codes' numbers come from the generated proto enum by name, and are pinned here as a
literal table: renaming, reordering or renumbering anything on either side fails. Each default
has one home (``evald/host/_limits.py`` for per-evaluation and engine settings,
``evald/daemon/_config.py`` for the rest); every shipped config and the docs' tables must say the
same.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from evald.contract import ErrorCode, pb
from evald.daemon._config import (
    HostSettings,
    ServerSettings,
    TenantLimits,
    parse_config,
    parse_size,
)
from evald.host import DEFAULT_COMPILE_MEMORY_BYTES, HostConfig, Limits

ROOT = Path(__file__).resolve().parents[3]

#: The wire contract (proto/evald/v1/evald.proto). Never renumber: clients depend on it.
WIRE_NUMBERS = {
    "syntax": 1,
    "division_by_zero": 2,
    "overflow": 3,
    "domain": 4,
    "too_large": 5,
    "fuel_exhausted": 6,
    "deadline_exceeded": 7,
    "memory_limit": 8,
    "stack_overflow": 9,
    "guest_fault": 10,
    "input_too_large": 11,
    "output_too_large": 12,
    "unknown_evaluator": 13,
    "permission_denied": 14,
    "quota_exceeded": 15,
    "unavailable": 16,
    "invalid_module": 17,
    "invalid_argument": 18,
    "internal": 19,
    "unauthenticated": 20,
}


def test_error_codes_have_their_pinned_wire_numbers() -> None:
    assert {code.value: code.proto_value for code in ErrorCode} == WIRE_NUMBERS
    for code in ErrorCode:
        assert ErrorCode.from_proto(code.proto_value) is code
        assert pb.ErrorCode.Name(code.proto_value) == f"ERROR_CODE_{code.name}"
    proto_names = {name for name in pb.ErrorCode.keys() if name != "ERROR_CODE_UNSPECIFIED"}
    assert proto_names == {f"ERROR_CODE_{code.name}" for code in ErrorCode}
    assert ErrorCode.from_proto(0) is ErrorCode.INTERNAL
    assert ErrorCode.from_proto(999) is ErrorCode.INTERNAL


def test_the_defaults_are_pinned() -> None:
    mib, kib = 2**20, 2**10
    assert Limits() == Limits(
        fuel=200_000_000,
        memory_bytes=64 * mib,
        deadline_ms=100,
        input_bytes=1 * mib,
        output_bytes=64 * kib,
        instance_cache_bytes=256 * mib,
    )
    host = HostConfig()
    assert (host.max_wasm_stack_bytes, host.module_bytes, host.epoch_tick_ms) == (
        256 * kib,
        4 * mib,
        1.0,
    )
    assert (host.load_fuel, host.load_deadline_ms, host.pool_instances) == (50_000_000, 2000, 256)
    tenant = TenantLimits()
    assert (tenant.max_concurrency, tenant.max_calls, tenant.unread_bytes) == (256, 256, 64 * mib)
    server = ServerSettings()
    assert (server.max_message_bytes, server.max_batch_items) == (8 * mib, 4096)
    assert (server.stream_unread_bytes, server.max_concurrent_rpcs) == (16 * mib, 1024)
    assert (server.compile_queue, server.compile_queue_per_tenant) == (8, 2)
    assert server.compile_memory_bytes == 512 * mib


def test_the_config_tables_take_their_defaults_from_the_one_home() -> None:
    limits, tenant = Limits(), TenantLimits()
    for name in (
        "fuel",
        "memory_bytes",
        "deadline_ms",
        "input_bytes",
        "output_bytes",
        "instance_cache_bytes",
    ):
        assert getattr(tenant, name) == getattr(limits, name), name
    assert ServerSettings().compile_memory_bytes == DEFAULT_COMPILE_MEMORY_BYTES
    host, settings = HostConfig(), HostSettings()
    for name in (
        "max_wasm_stack_bytes",
        "module_bytes",
        "epoch_tick_ms",
        "isolation",
        "load_fuel",
        "load_deadline_ms",
        "allocator",
        "pool_instances",
        "pool_memory_bytes",
        "instances_per_thread",
    ):
        assert getattr(settings, name) == getattr(host, name), name
    assert parse_config("").default_limits == TenantLimits()


def _value(key: str, raw: Any, default: Any) -> Any:
    """A shipped config's value in the dataclass's terms."""
    if key == "socket_mode":
        return int(raw, 8)
    if key == "cpus":  # a cpu-list, read as the daemon reads it
        return parse_config(f"[server]\ncpus = {raw!r}\n").server.cpus
    if isinstance(default, int) and isinstance(raw, str):
        return parse_size(raw, key)
    return raw


def _agree(table: dict[str, Any], defaults: Any, where: str) -> None:
    for key, raw in table.items():
        assert hasattr(defaults, key), f"{where}: {key} is not a setting"
        assert _value(key, raw, getattr(defaults, key)) == getattr(defaults, key), (
            f"{where}: {key} = {raw!r} but the default is {getattr(defaults, key)!r}"
        )


def test_the_packaged_config_states_exactly_the_defaults() -> None:
    document = tomllib.loads((ROOT / "evald" / "daemon" / "default_config.toml").read_text())
    _agree(document["server"], ServerSettings(), "default_config.toml [server]")
    _agree(document["host"], HostSettings(), "default_config.toml [host]")
    _agree(document["defaults"]["limits"], TenantLimits(), "default_config.toml [defaults]")
    # every setting is documented there
    assert set(document["defaults"]["limits"]) == set(vars(TenantLimits()))
    assert set(document["host"]) == set(vars(HostSettings()))
    assert set(document["server"]) == set(vars(ServerSettings()))


def _deployed_configs() -> list[tuple[str, str]]:
    secret = yaml.safe_load((ROOT / "deploy" / "k8s" / "evald-config.secret.yaml").read_text())
    return [
        ("deploy/systemd/evald.toml", (ROOT / "deploy" / "systemd" / "evald.toml").read_text()),
        ("deploy/k8s/evald-config.secret.yaml", secret["stringData"]["evald.toml"]),
    ]


@pytest.mark.parametrize("where,text", _deployed_configs(), ids=["systemd", "k8s"])
def test_deployed_configs_restate_the_defaults_they_name(where: str, text: str) -> None:
    document = tomllib.loads(text)
    parse_config(text, where)  # valid
    # [server] is where a deployment differs on purpose (socket mode, threads, metrics); the
    # limits and the engine settings it names must be the defaults.
    _agree(document.get("defaults", {}).get("limits", {}), TenantLimits(), f"{where} limits")
    _agree(document.get("host", {}), HostSettings(), f"{where} [host]")


def _size_text(value: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if value % size == 0:
            return f"{value // size} {unit}"
    return str(value)


def _row(text: str, label: str) -> str:
    for line in text.splitlines():
        if line.startswith("| ") and label in line.split("|")[1]:
            return line.split("|")[2].strip()
    raise AssertionError(f"no table row for {label!r}")


def test_the_docs_tables_state_the_defaults() -> None:
    limits, host, tenant = Limits(), HostConfig(), TenantLimits()
    daemon_md = (ROOT / "docs" / "daemon.md").read_text()
    expected = {
        "`fuel`": f"{limits.fuel:,}",
        "`memory_bytes`": _size_text(limits.memory_bytes),
        "`deadline_ms`": str(limits.deadline_ms),
        "wasm stack": _size_text(host.max_wasm_stack_bytes),
        "`input_bytes`": _size_text(limits.input_bytes),
        "`output_bytes`": _size_text(limits.output_bytes),
        "module size": _size_text(host.module_bytes),
        "`max_concurrency`": str(tenant.max_concurrency),
        "`max_calls`": str(tenant.max_calls),
        "`unread_bytes`": _size_text(tenant.unread_bytes),
        "`instance_cache_bytes`": _size_text(tenant.instance_cache_bytes),
    }
    for label, value in expected.items():
        assert _row(daemon_md, label) == value, label
    server = ServerSettings()
    listed = re.search(r"`max_message_bytes` \(([^)]*)\), `max_batch_items` \((\d+)\)", daemon_md)
    assert listed is not None
    assert listed.groups() == (_size_text(server.max_message_bytes), str(server.max_batch_items))

    readme = (ROOT / "README.md").read_text()
    assert _row(readme, "fuel per evaluation") == f"{limits.fuel:,}"
    assert _row(readme, "guest linear memory") == _size_text(limits.memory_bytes)
    assert _row(readme, "deadline per evaluation") == f"{limits.deadline_ms} ms"
    assert _row(readme, "wasm stack") == _size_text(host.max_wasm_stack_bytes)
    assert _row(readme, "input / output") == (
        f"{_size_text(limits.input_bytes)} / {_size_text(limits.output_bytes)}"
    )
    assert _row(readme, "module size").startswith(_size_text(host.module_bytes) + ";")
    assert _row(readme, "evaluations in flight per tenant") == str(tenant.max_concurrency)
