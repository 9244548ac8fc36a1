"""The state folder is checked at load as a registration is: against real daemons restarted on
an index edited by hand.

Adding ``"calc"`` to a tenant's index file and restarting made that tenant's ``calc`` run its
own module. Now an entry with a reserved name, one whose module's manifest names another
evaluator and entries past ``max_modules`` are each logged and not
served (left in the index, so fixing the file brings them back); the daemon starts and serves
the rest.
"""

from __future__ import annotations

import json
from pathlib import Path

from daemon_harness import Daemon, module, outcome, start_daemon, tenant_block


def _config() -> str:
    return "\n".join(
        [
            "[server]",
            "threads = 2",
            "shutdown_grace_s = 2",
            tenant_block("alpha", evaluators=["calc"], allow_register=True, max_modules=4),
            tenant_block("cramped", allow_register=True, max_modules=1),
        ]
    )


def _start(root: Path) -> Daemon:
    return start_daemon(root, _config(), state_dir=root / "state")


def _index(daemon: Daemon, tenant: str) -> Path:
    return daemon.state_dir / "tenants" / f"{tenant}.json"


def _refusals(daemon: Daemon) -> dict[str, str]:
    return {
        line["evaluator"]: line["error"]
        for line in daemon.log_lines()
        if line.get("msg") == "registered module not served"
    }


def test_index_entries_are_held_to_the_registration_rules_at_load(tmp_path: Path) -> None:
    daemon = _start(tmp_path)
    alpha = daemon.client("alpha")
    mine = alpha.register(module("echo", "mine"))
    tagged = alpha.register(module("echo", "tagged"))
    second = alpha.register(module("echo", "second"))
    cramped = daemon.client("cramped")
    first = cramped.register(module("echo", "first"))
    assert daemon.stop() == 0

    document = json.loads(_index(daemon, "alpha").read_text())
    entries = document["modules"]
    entries["calc"] = dict(entries["mine"])  # a reserved name, pointing at alpha's echo
    entries["renamed"] = dict(entries["mine"])  # its module's manifest says "mine"
    _index(daemon, "alpha").write_text(json.dumps(document))
    document = json.loads(_index(daemon, "cramped").read_text())
    document["modules"]["second"] = {"sha256": second.sha256}  # past max_modules = 1
    _index(daemon, "cramped").write_text(json.dumps(document))

    daemon = _start(tmp_path)
    try:
        alpha = daemon.client("alpha")
        result = alpha.evaluate("calc", "1+1")
        assert (outcome(result), result.value) == ("ok", "2"), "calc must be the standard one"
        assert alpha.evaluate("mine", b"x").value == "x"
        assert alpha.evaluate("tagged", b"y").value == "y"
        assert outcome(alpha.evaluate("renamed", b"z")) == "unknown_evaluator"
        listed = {info.name: info.sha256 for info in alpha.list_evaluators()}
        assert listed["mine"] == mine.sha256 and listed["tagged"] == tagged.sha256
        assert "renamed" not in listed
        cramped = daemon.client("cramped")
        assert [info.name for info in cramped.list_evaluators() if info.owner == "cramped"] == [
            "first"
        ]
        assert cramped.evaluate("first", b"w").value == "w"
        assert first.sha256 in {info.sha256 for info in cramped.list_evaluators()}
        refused = _refusals(daemon)
        assert set(refused) == {"calc", "renamed"}, refused
        assert "reserved" in refused["calc"]
        assert "manifest names it 'mine'" in refused["renamed"]
        # entries past max_modules are not loaded at all: one line says how many
        past = [
            line
            for line in daemon.log_lines()
            if line.get("msg") == "registered modules not served: past max_modules"
        ]
        assert [(line["tenant"], line["entries"]) for line in past] == [("cramped", 1)]
        # left in the index: the operator's file is not rewritten at load
        assert set(json.loads(_index(daemon, "alpha").read_text())["modules"]) == {
            "calc",
            "mine",
            "renamed",
            "second",
            "tagged",
        }
    finally:
        assert daemon.stop() == 0
