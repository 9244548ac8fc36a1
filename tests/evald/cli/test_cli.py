"""The `evald` command line against the real daemon: the call contract (stdout value and exit
0; `error: CODE: message` and exit 2; exit 1 only when unreachable) and the other commands."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from daemon_harness import EVALD, TOKENS, Daemon, module

from evald.cli import Runner, command, commands
from evaluators_wasm import wasm_path

CORE_COMMANDS = {"serve", "call", "evaluators", "register", "unregister", "hash-token", "health"}


def evald(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [EVALD, *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_every_subcommand() -> None:
    result = evald("--help")
    assert result.returncode == 0
    registered = {cmd.name for cmd in commands()}
    assert registered >= CORE_COMMANDS
    for name in registered:
        assert name in result.stdout
    bare = evald()
    assert bare.returncode == 2 and "call" in bare.stderr


def test_a_subcommand_name_cannot_be_taken_twice() -> None:
    def configure(parser: argparse.ArgumentParser) -> Runner:
        return lambda args: 0

    with pytest.raises(ValueError, match="registered twice"):
        command("call", "another call")(configure)


@pytest.fixture(scope="module")
def echo_registered(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("cli") / "cli_echo.wasm"
    path.write_bytes(module("echo", "cli_echo"))
    result = daemon.cli("register", str(path), "--replace")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("registered cli_echo 1.0.0")
    return "cli_echo"


def test_call_prints_the_value_and_exits_0(daemon: Daemon, echo_registered: str) -> None:
    result = daemon.cli("call", echo_registered, "héllo <world>")
    assert (result.returncode, result.stdout, result.stderr) == (0, "héllo <world>\n", "")
    dashed = daemon.cli("call", echo_registered, "--", "-5 + 3")
    assert (dashed.returncode, dashed.stdout) == (0, "-5 + 3\n")
    piped = subprocess.run(
        [EVALD, "call", "--target", daemon.target, echo_registered, "-"],
        input=b"from stdin",
        capture_output=True,
        timeout=60,
    )
    assert (piped.returncode, piped.stdout) == (0, b"from stdin\n")


def test_call_calc_end_to_end(daemon: Daemon) -> None:
    if not wasm_path("calc").exists():
        pytest.skip("calc.wasm is not built")
    result = daemon.cli("call", "calc", "17 * 23 + 91")
    assert (result.returncode, result.stdout) == (0, "482\n")
    failed = daemon.cli("call", "calc", "1 / 0")
    assert failed.returncode == 2 and failed.stdout == ""
    assert failed.stderr.startswith("error: division_by_zero: ")


def test_call_errors_exit_2_with_code_and_message(daemon: Daemon, tmp_path: Path) -> None:
    missing = daemon.cli("call", "no_such_evaluator", "x")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.startswith("error: unknown_evaluator: ")
    assert missing.stderr.count("\n") == 1
    path = tmp_path / "cli_trap.wasm"
    path.write_bytes(module("trap", "cli_trap"))
    assert daemon.cli("register", str(path), "--replace").returncode == 0
    trapped = daemon.cli("call", "cli_trap", "x")
    assert trapped.returncode == 2
    assert trapped.stderr.startswith("error: guest_fault: ")
    denied = daemon.cli("call", "--token", "wrong", "cli_trap", "x")
    assert denied.returncode == 2
    assert denied.stderr.startswith("error: permission_denied: ")


def test_call_exits_1_only_when_the_daemon_cannot_be_reached(tmp_path: Path) -> None:
    result = evald("call", "--target", f"unix:{tmp_path / 'absent.sock'}", "calc", "1")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("error: unreachable: ")
    health = evald("health", "--target", f"unix:{tmp_path / 'absent.sock'}")
    assert health.returncode == 1


def test_evald_target_env_is_the_default_target(daemon: Daemon, echo_registered: str) -> None:
    result = evald("call", echo_registered, "via env", env={"EVALD_TARGET": daemon.target})
    assert (result.returncode, result.stdout) == (0, "via env\n")


def test_evaluators_lists_what_the_tenant_may_call(daemon: Daemon, echo_registered: str) -> None:
    result = daemon.cli("evaluators", "--json")
    assert result.returncode == 0, result.stderr
    listed = {info["name"]: info for info in map(json.loads, result.stdout.splitlines())}
    assert listed[echo_registered]["owner"] == "local"
    viewer = daemon.cli("evaluators", "--json", "--token", TOKENS["viewer"])
    names = {json.loads(line)["name"] for line in viewer.stdout.splitlines()}
    assert echo_registered not in names
    table = daemon.cli("evaluators")
    assert table.returncode == 0 and echo_registered in table.stdout


def test_register_refusal_and_unregister(daemon: Daemon, tmp_path: Path) -> None:
    bad = tmp_path / "bad.wasm"
    bad.write_bytes(b"definitely not wasm")
    refused = daemon.cli("register", str(bad))
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: invalid_module: ")
    good = tmp_path / "gone.wasm"
    good.write_bytes(module("echo", "cli_gone"))
    assert daemon.cli("register", str(good)).returncode == 0
    removed = daemon.cli("unregister", "cli_gone")
    assert (removed.returncode, removed.stdout) == (0, "unregistered cli_gone\n")
    after = daemon.cli("call", "cli_gone", "x")
    assert after.returncode == 2 and after.stderr.startswith("error: unknown_evaluator: ")
    unreadable = daemon.cli("register", str(tmp_path / "absent.wasm"))
    assert unreadable.returncode == 2 and "cannot read" in unreadable.stderr


def test_hash_token() -> None:
    fresh = evald("hash-token", "--json")
    document = json.loads(fresh.stdout)
    assert len(document["token"]) >= 32
    assert document["token_sha256"] == hashlib.sha256(document["token"].encode()).hexdigest()
    given = evald("hash-token", "abc")
    assert given.stdout == f'token_sha256 = "{hashlib.sha256(b"abc").hexdigest()}"\n'
    piped = evald("hash-token", "-", stdin="abc\n")
    assert piped.stdout == given.stdout


def test_health(daemon: Daemon) -> None:
    result = daemon.cli("health")
    assert (result.returncode, result.stdout) == (0, "SERVING\n")


def test_serve_refuses_an_invalid_config_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[[tenants]]\nname = 'a'\n[tenants.limits]\nfule = 1\n")
    result = evald("serve", "--config", str(config), "--listen", f"unix:{tmp_path / 's.sock'}")
    assert result.returncode == 2
    assert "tenants[0].limits.fule: unknown key" in result.stderr
