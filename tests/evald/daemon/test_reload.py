"""A live reload of the embedded store (SIGHUP, ``evald reload``): tenants added, removed, given
a new token or new limits, without dropping calls, against a real daemon.

Each test waits for the daemon's own word that it reloaded (its revision, its log line), not a
time.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import grpc
import pytest
from daemon_harness import EVALD, TOKENS, Daemon, module, outcome, start_daemon, tenant_block
from fleet_harness import one_item, open_stream, until

from evald.client import CallError, Client
from evald.daemon import hash_token


def _config(*tenants: str) -> str:
    return "\n".join(["[server]", "threads = 2", "shutdown_grace_s = 2", *tenants])


def _reloaded(daemon: Daemon, count: int) -> None:
    until(
        lambda: sum(line.get("msg") == "config reloaded" for line in daemon.log_lines()) >= count,
        f"{count} reloads",
    )


def test_sighup_applies_added_removed_and_changed_tenants_without_dropping_calls(
    tmp_path: Path,
) -> None:
    daemon = start_daemon(
        tmp_path,
        _config(tenant_block("alpha", allow_register=True), tenant_block("viewer")),
    )
    try:
        alpha = daemon.client("alpha")
        alpha.register(module("echo", "mine"))
        revision = alpha.revision()
        outgoing, responses = open_stream(daemon, TOKENS["alpha"])
        outgoing.put(one_item("mine", b"before", "1"))
        assert next(responses).results[0].value == "before"
        viewer_stream, viewer_responses = open_stream(daemon, TOKENS["viewer"])
        # Answered, so the daemon has accepted the stream before the reload (on a loaded
        # machine its opening could otherwise reach the daemon after the token is gone, and
        # be refused as a new stream instead of ended as a revoked one).
        viewer_stream.put(one_item("calc", b"1 + 1", "1"))
        answered = next(viewer_responses).results[0]
        assert answered.WhichOneof("outcome") is not None, answered

        rotated = "alpha-second-token-0123456789"
        two_tokens = "\n".join(
            [
                "[[tenants]]",
                'name = "alpha"',
                f'token_sha256s = ["{hash_token(TOKENS["alpha"])}", "{hash_token(rotated)}"]',
                "allow_register = true",
                "[tenants.limits]",
                "input_bytes = 10",
                "",
            ]
        )
        daemon.config_path.write_text(_config(two_tokens, tenant_block("narrow")))
        daemon.process.send_signal(signal.SIGHUP)
        _reloaded(daemon, 1)
        assert alpha.revision() > revision
        # alpha: both tokens, the new limit on the next call, its open stream untouched
        assert outcome(alpha.evaluate("mine", b"x" * 11)) == "input_too_large"
        assert Client(daemon.target, rotated).evaluate("mine", b"ok").value == "ok"
        outgoing.put(one_item("mine", b"after", "2"))
        assert next(responses).results[0].value == "after"
        outgoing.put(None)
        # narrow: added
        assert daemon.client("narrow").list_evaluators() is not None
        # viewer: removed, refused, its open stream ended with unauthenticated
        with pytest.raises(CallError) as refused:
            daemon.client("viewer").list_evaluators()
        assert refused.value.code is not None and refused.value.code.value == "permission_denied"
        with pytest.raises(grpc.RpcError) as ended:
            next(viewer_responses)
        assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
        viewer_stream.put(None)
    finally:
        assert daemon.stop() == 0


def test_evald_reload_and_a_bad_config_changes_nothing(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, _config(tenant_block("alpha", allow_register=True)))
    try:
        daemon.config_path.write_text(_config(tenant_block("alpha"), "[server]\nnope = 1"))
        result = subprocess.run(
            [EVALD, "reload", "--state-dir", str(daemon.state_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0 and f"pid {daemon.pid}" in result.stdout, result.stderr
        until(
            lambda: any(line.get("msg") == "config not reloaded" for line in daemon.log_lines()),
            "the refusal",
        )
        # still the old config: alpha may register
        daemon.client("alpha").register(module("echo", "still"))
        daemon.config_path.write_text(_config(tenant_block("alpha"), tenant_block("beta")))
        result = subprocess.run(
            [EVALD, "reload", "--state-dir", str(daemon.state_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        _reloaded(daemon, 1)
        assert daemon.client("beta").list_evaluators() is not None
        with pytest.raises(CallError) as refused:
            daemon.client("alpha").register(module("echo", "denied"))
        assert refused.value.code is not None and refused.value.code.value == "permission_denied"
        assert daemon.client("alpha").evaluate("still", b"kept").value == "kept"
    finally:
        assert daemon.stop() == 0
    gone = subprocess.run(
        [EVALD, "reload", "--state-dir", str(daemon.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert gone.returncode == 1 and "no daemon holds" in gone.stderr
