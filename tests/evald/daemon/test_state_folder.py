"""The state folder trusts none of its files: each attack of the hardening round 3, against real
daemons restarted on a folder changed by hand.

Every file is opened without following links, checked against the hash the index records (the
compiled artefact against the module it was compiled from), bounded in size and depth; a bad
entry is logged once and skipped, and the daemon always starts and serves the rest.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from daemon_harness import Daemon, module, outcome, start_daemon, tenant_block


def _config() -> str:
    return "\n".join(
        [
            "[server]",
            "threads = 2",
            "shutdown_grace_s = 2",
            tenant_block("alpha", allow_register=True),
            tenant_block("beta", allow_register=True),
        ]
    )


def _start(root: Path) -> Daemon:
    return start_daemon(root, _config(), state_dir=root / "state")


def _lines(daemon: Daemon, message: str) -> list[dict[str, object]]:
    return [line for line in daemon.log_lines() if line.get("msg") == message]


def _module_file(daemon: Daemon, sha256: str) -> Path:
    return daemon.state_dir / "modules" / f"{sha256}.wasm"


def test_an_index_linked_to_another_tenants_serves_nothing_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    daemon = _start(tmp_path)
    mine = daemon.client("alpha").register(module("echo", "mine"))
    theirs = daemon.client("beta").register(module("output", "theirs", 3))
    assert daemon.stop() == 0
    index = daemon.state_dir / "tenants" / "alpha.json"
    index.unlink()
    index.symlink_to(daemon.state_dir / "tenants" / "beta.json")

    daemon = _start(tmp_path)
    try:
        alpha = daemon.client("alpha")
        assert outcome(alpha.evaluate("theirs", b"x")) == "unknown_evaluator"
        assert "theirs" not in {info.name for info in alpha.list_evaluators()}
        assert set(daemon.client("beta").evaluate("theirs", b"x").value) == {"x"}
        # alpha's own module file is kept (the index may be repaired by hand)
        assert _module_file(daemon, mine.sha256).is_file()
        assert _module_file(daemon, theirs.sha256).is_file()
        refused = _lines(daemon, "tenant index unreadable")
        assert len(refused) == 1, refused
        assert "symbolic link" in str(refused[0]["error"])
    finally:
        assert daemon.stop() == 0


def test_a_copied_index_of_another_tenant_is_refused(tmp_path: Path) -> None:
    daemon = _start(tmp_path)
    daemon.client("beta").register(module("output", "theirs", 3))
    assert daemon.stop() == 0
    tenants = daemon.state_dir / "tenants"
    shutil.copyfile(tenants / "beta.json", tenants / "alpha.json")

    daemon = _start(tmp_path)
    try:
        assert outcome(daemon.client("alpha").evaluate("theirs", b"x")) == "unknown_evaluator"
        refused = _lines(daemon, "tenant index unreadable")
        assert len(refused) == 1 and "not of 'alpha'" in str(refused[0]["error"]), refused
    finally:
        assert daemon.stop() == 0


def test_a_compiled_module_swapped_for_another_modules_is_not_run(tmp_path: Path) -> None:
    daemon = _start(tmp_path)
    alpha = daemon.client("alpha")
    one = alpha.register(module("echo", "one"))
    two = alpha.register(module("output", "two", 3))
    assert daemon.stop() == 0
    cache = daemon.state_dir / "cache"
    (source,) = cache.glob(f"{two.sha256}-*.cwasm")
    (target,) = cache.glob(f"{one.sha256}-*.cwasm")
    shutil.copyfile(source, target)  # a valid compiled module, of another module

    daemon = _start(tmp_path)
    try:
        result = daemon.client("alpha").evaluate("one", b"abc")
        assert (outcome(result), result.value) == ("ok", "abc"), "one must run its own code"
        log = daemon.log_path.read_text()
        assert "not this module's" in log
    finally:
        assert daemon.stop() == 0


def test_an_index_nested_200000_deep_does_not_stop_the_start(tmp_path: Path) -> None:
    daemon = _start(tmp_path)
    daemon.client("beta").register(module("echo", "kept"))
    assert daemon.stop() == 0
    (daemon.state_dir / "tenants" / "alpha.json").write_text("[" * 200_000 + "]" * 200_000)

    daemon = _start(tmp_path)
    try:
        assert daemon.client("beta").evaluate("kept", b"ok").value == "ok"
        refused = _lines(daemon, "tenant index unreadable")
        assert len(refused) == 1 and "nests" in str(refused[0]["error"]), refused
    finally:
        assert daemon.stop() == 0


def test_a_fifo_in_place_of_a_module_does_not_hang_the_start(tmp_path: Path) -> None:
    daemon = _start(tmp_path)
    gone = daemon.client("alpha").register(module("echo", "gone"))
    daemon.client("beta").register(module("echo", "kept"))
    assert daemon.stop() == 0
    path = _module_file(daemon, gone.sha256)
    path.unlink()
    os.mkfifo(path)

    daemon = _start(tmp_path)
    try:
        assert daemon.client("beta").evaluate("kept", b"ok").value == "ok"
        assert outcome(daemon.client("alpha").evaluate("gone", b"x")) == "unknown_evaluator"
        refused = _lines(daemon, "registered module not served")
        assert len(refused) == 1 and "not a regular file" in str(refused[0]["error"]), refused
    finally:
        assert daemon.stop() == 0


def test_a_39_mb_index_is_refused_unread_in_one_short_line(tmp_path: Path) -> None:
    daemon = _start(tmp_path)
    daemon.client("beta").register(module("echo", "kept"))
    assert daemon.stop() == 0
    entry = {"sha256": "0" * 64, "registered_at": ""}
    modules = {f"name{index:07d}" + "x" * 300: entry for index in range(100_000)}
    text = json.dumps({"version": 1, "tenant": "alpha", "modules": modules})
    (daemon.state_dir / "tenants" / "alpha.json").write_text(text)
    assert len(text) > 39_000_000

    daemon = _start(tmp_path)
    try:
        assert daemon.client("beta").evaluate("kept", b"ok").value == "ok"
        refused = _lines(daemon, "tenant index unreadable")
        assert len(refused) == 1 and "bytes" in str(refused[0]["error"]), refused
        assert daemon.log_path.stat().st_size < 64 * 1024
    finally:
        assert daemon.stop() == 0
