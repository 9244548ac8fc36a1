"""Deleted and replaced modules give their memory back, and a tenant's kept instances are
bounded; against a real daemon, measured by its resident memory.

With ``max_modules = 1``, registering, calling and deleting a module that fills 48 MiB, 16
times, once left the idle daemon at 848 MiB: a deletion evicted only the deleting thread's
instances (the control thread has none), and each worker kept up to 64. Now every worker's
instances of a deleted or replaced module go, and a tenant's kept instances hold at most its
``instance_cache_bytes``, every worker together.

Each test runs under both isolation modes. Under ``reuse`` a kept instance keeps every page its
calls wrote, so an instance left behind shows in the resident memory; under ``fresh`` (the
default) every kept instance is put back after each call, its written pages given back to the
kernel, so the resident memory stays low even if instances were left behind (those tests check
that the pages go).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from daemon_harness import Daemon, module, outcome, start_daemon, tenant_block

from evald.contract import pb
from evald.testing import PAGE, arg, guest, manifest_bytes

MIB = 2**20
FILL_PAGES = 48 * MIB // PAGE  # each call writes 48 MiB of guest memory
#: Six cycles: a leak of every cycle but the last would leave 5 x 96 MiB (48 MiB on each of
#: the two workers), five times what the tests allow.
CYCLES = 6


def _config(isolation: str) -> str:
    # Filling 48 MiB is the point, not its speed: a deadline a loaded machine meets too.
    return "\n".join(
        [
            "[server]",
            "threads = 2",
            "shutdown_grace_s = 2",
            "[host]",
            f'isolation = "{isolation}"',
            tenant_block(
                "cramped",
                allow_register=True,
                max_modules=1,
                limits={"memory_bytes": "64MiB", "max_running": 2, "deadline_ms": 30_000},
            ),
            tenant_block(
                "alpha",
                allow_register=True,
                max_modules=8,
                limits={
                    "memory_bytes": "64MiB",
                    "max_running": 2,
                    "deadline_ms": 30_000,
                    "instance_cache_bytes": "64MiB",
                },
            ),
        ]
    )


@pytest.fixture(params=["reuse", "fresh"])
def daemon(tmp_path: Path, request: pytest.FixtureRequest) -> Daemon:
    handle = start_daemon(tmp_path, _config(request.param))
    yield handle  # type: ignore[misc]
    assert handle.stop() == 0


def _rss(daemon: Daemon) -> int:
    rss = daemon.rss_bytes()
    assert rss is not None, "the daemon died"
    return rss


def _fill_on_every_worker(daemon: Daemon, tenant: str, name: str) -> None:
    """Calls ``name`` in a batch the scheduler spreads over both workers."""
    items = [pb.EvaluateRequest(evaluator=name, input=arg(FILL_PAGES), id=str(i)) for i in range(8)]
    client = daemon.client(tenant, timeout_s=60.0)
    results = client._invoke(client._stub.EvaluateBatch, pb.EvaluateBatchRequest(items=items))
    assert [outcome(result) for result in results.results] == ["ok"] * len(items)


def test_deleted_modules_give_their_memory_back(daemon: Daemon) -> None:
    client = daemon.client("cramped", timeout_s=60.0)
    baseline = _rss(daemon)
    for cycle in range(CYCLES):
        name = f"filler{cycle}"
        client.register(module("fill", name))
        _fill_on_every_worker(daemon, "cramped", name)
        client.delete(name)
    after = _rss(daemon)
    print(f"idle RSS after {CYCLES} cycles of 48 MiB: {baseline // MIB} -> {after // MIB} MiB")
    # one cycle's instances alone would be 48 MiB a worker; six left behind, 576 MiB
    assert after - baseline < 96 * MIB, (baseline // MIB, after // MIB)


def test_replaced_modules_give_their_memory_back(daemon: Daemon) -> None:
    client = daemon.client("cramped", timeout_s=60.0)
    baseline = _rss(daemon)
    for cycle in range(CYCLES):
        # new bytes under one name: each replace makes the previous module's instances go
        manifest = manifest_bytes(
            name="replaced", tag="replaced", semantics_version="replaced/1", version=f"1.0.{cycle}"
        )
        wasm = guest("fill", manifest=manifest)
        client.register(wasm, replace=True)
        _fill_on_every_worker(daemon, "cramped", "replaced")
    client.delete("replaced")
    after = _rss(daemon)
    print(f"idle RSS after {CYCLES} replacements of 48 MiB: {baseline // MIB} -> {after // MIB}")
    assert after - baseline < 96 * MIB, (baseline // MIB, after // MIB)


def test_a_tenants_kept_instances_stay_within_instance_cache_bytes(daemon: Daemon) -> None:
    client = daemon.client("alpha", timeout_s=60.0)
    baseline = _rss(daemon)
    for index in range(8):  # eight modules, 48 MiB on each worker: 768 MiB without the cap
        client.register(module("fill", f"kept{index}"))
        _fill_on_every_worker(daemon, "alpha", f"kept{index}")
    after = _rss(daemon)
    print(f"idle RSS with 8 filled modules, a 64 MiB cap: {baseline // MIB} -> {after // MIB}")
    assert after - baseline < 64 * MIB + 48 * MIB, (baseline // MIB, after // MIB)
    # the modules still answer (each call makes a new instance when its old one went)
    assert client.evaluate("kept0", arg(1)).value == "ok"
