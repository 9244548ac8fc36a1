"""Registration: malformed modules are refused with a clear error; names are scoped and
reserved; modules survive a kill -9 of the daemon."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Daemon, module, outcome, session_config, start_daemon

from evald.client import CallError, Client
from evald.testing import arg, guest, manifest_bytes


def refusal(client: Client, wasm: bytes, **options: Any) -> CallError:
    with pytest.raises(CallError) as info:
        client.register(wasm, **options)
    return info.value


def stored_modules(daemon: Daemon) -> set[str]:
    return {path.name for path in (daemon.state_dir / "modules").iterdir()}


@pytest.mark.parametrize(
    ("wasm", "reason"),
    [
        (b"this is not wasm", "not a WebAssembly module"),
        (guest("echo", imports='(import "env" "clock" (func))'), "import"),
        (guest("echo", omit=("evald_eval",)), "evald_eval"),
        (guest("echo", omit=("evald_output_cap",)), "evald_output_cap"),
        (guest("echo", retype={"evald_eval": "(param i32)"}), "evald_eval"),
        (guest("echo", start="(loop $forever (br $forever))"), "start function"),
        (guest("echo", pages=17), "memory"),
        (guest("echo", manifests=0), "manifest"),
        (guest("echo", manifests=2), "manifest"),
        (guest("echo", manifest=b"{not json"), "manifest"),
        (guest("echo", manifest=manifest_bytes(name="Bad Name")), "name"),
        (guest("echo", manifest=manifest_bytes(result_regex=...)), "result_regex"),
        (guest("echo", abi_version=2), "evald_abi_version"),
    ],
    ids=[
        "not-wasm",
        "import",
        "missing-eval",
        "missing-buffer-export",
        "mistyped-eval",
        "looping-start",
        "memory-min-above-cap",
        "no-manifest",
        "two-manifests",
        "manifest-not-json",
        "manifest-bad-name",
        "manifest-missing-field",
        "abi-version",
    ],
)
def test_malformed_modules_are_refused_at_registration(
    daemon: Daemon, wasm: bytes, reason: str
) -> None:
    client = daemon.client("limits")  # memory cap 1 MiB = 16 pages
    before = stored_modules(daemon)
    error = refusal(client, wasm)
    assert error.code is not None and error.code.value == "invalid_module"
    assert reason.lower() in error.message.lower(), error.message
    assert stored_modules(daemon) == before
    # The daemon keeps serving the same tenant.
    client.register(module("echo", "after_refusal"), replace=True)
    response = client.evaluate("after_refusal", b"fine")
    assert (outcome(response), response.value) == ("ok", "fine")


def test_standard_names_and_tags_are_reserved(daemon: Daemon) -> None:
    client = daemon.client("beta")
    for changes in ({"name": "calc", "tag": "mycalc"}, {"name": "mycalc", "tag": "calc"}):
        error = refusal(client, guest("echo", manifest=manifest_bytes(**changes)))
        assert error.code is not None and error.code.value == "invalid_argument"
        assert "reserved" in error.message


def test_register_replace_and_delete(daemon: Daemon) -> None:
    client = daemon.client("beta")
    first = client.register(module("echo", "versioned"))
    assert first.owner == "beta" and first.name == "versioned"
    assert client.evaluate("versioned", b"one").value == "one"
    error = refusal(client, module("output", "versioned"))
    assert error.code is not None and error.code.value == "invalid_argument"
    assert "replace" in error.message
    second = client.register(module("output", "versioned"), replace=True)
    assert second.sha256 != first.sha256
    for _ in range(4):  # every worker thread sees the new module
        assert client.evaluate("versioned", arg(3)).value == "xxx"
    assert f"{first.sha256}.wasm" not in stored_modules(daemon)  # the old bytes are gone
    client.delete("versioned")
    assert outcome(client.evaluate("versioned", b"")) == "unknown_evaluator"
    assert f"{second.sha256}.wasm" not in stored_modules(daemon)
    with pytest.raises(CallError) as missing:
        client.delete("versioned")
    assert missing.value.code is not None and missing.value.code.value == "unknown_evaluator"
    with pytest.raises(CallError) as standard:
        client.delete("calc")
    assert standard.value.code is not None and standard.value.code.value == "permission_denied"


def test_evaluators_resolve_by_tag_too(daemon: Daemon) -> None:
    client = daemon.client("beta")
    wasm = guest("echo", manifest=manifest_bytes(name="by_name", tag="tg"))
    client.register(wasm, replace=True)
    assert client.evaluate("tg", b"tagged").value == "tagged"
    assert client.evaluate("by_name", b"named").value == "named"


def test_max_modules_per_tenant(daemon: Daemon) -> None:
    client = daemon.client("cramped")
    client.register(module("echo", "only_one"))
    error = refusal(client, module("echo", "one_too_many"))
    assert error.code is not None and error.code.value == "invalid_argument"
    assert "max_modules" in error.message
    client.register(module("output", "only_one"), replace=True)
    assert client.evaluate("only_one", arg(2)).value == "xx"


def test_a_tenant_without_allow_register_cannot_register(daemon: Daemon) -> None:
    error = refusal(daemon.client("viewer"), module("echo", "nope"))
    assert error.code is not None and error.code.value == "permission_denied"
    assert "allow_register" in error.message


def test_registered_modules_survive_kill_9(tmp_path: Path) -> None:
    config = session_config(0).replace('metrics_listen = "127.0.0.1:0"', 'metrics_listen = ""')
    first = start_daemon(tmp_path, config)
    try:
        first.client("alpha").register(module("output", "durable"))
        first.client().register(module("echo", "durable_local"))
    finally:
        first.kill()
    assert first.socket_path.exists()  # a stale socket is left behind ...
    second = start_daemon(tmp_path, config)  # ... and the next daemon replaces it
    try:
        alpha = second.client("alpha")
        listed = {info.name: info.owner for info in alpha.list_evaluators()}
        assert listed.get("durable") == "alpha"
        assert alpha.evaluate("durable", arg(4)).value == "xxxx"
        assert second.client().evaluate("durable_local", b"again").value == "again"
        assert "durable" not in {info.name for info in second.client("beta").list_evaluators()}
    finally:
        assert second.stop() == 0
