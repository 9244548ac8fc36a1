"""The control plane off one thread, against real daemons, real compiles and real reloads.

1. A revocation (SIGHUP) applies while another tenant's module compiles: compiles run on the
   module thread, changes on the control thread (the revocation waited for the compile: 6.4 s).
2. A registration whose token is revoked while it compiles changes nothing: at commit the
   call's token must still name its tenant (it committed after the revocation and replaced the
   tenant's evaluator).
3. A daemon serves before its stored modules are loaded: health is SERVING and what is still
   loading answers ``unavailable`` (loading, retry), then it is served (a new daemon compiled
   every module before it bound its socket: 13.8 s with two modules).
4. A manifest holding ``\\u0000`` is refused ``invalid_module``, not ``unavailable ... retry``.
5. A deleted evaluator's and a removed tenant's metric series are removed (35 series and
   2.7 KiB stayed per name ever registered).

A compile that runs as long as a test needs is the real compile worker stopped with SIGSTOP
(as in test_compile_sandbox.py); the start-up load is a real module of 80 functions at the
compile-cost limits, which takes seconds to compile. Each test reads what the daemon decided
(its log lines, its answers), never two clocks.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from daemon_harness import (
    TOKENS,
    Daemon,
    free_port,
    module,
    outcome,
    start_daemon,
    tenant_block,
)
from fleet_harness import until

from evald.client import CallError, Client
from evald.daemon import hash_token
from evald.daemon._store import ModuleStore
from evald.testing import (
    branchy_function,
    guest,
    manifest_bytes,
    process_alive,
    process_descendants,
    wait_serving,
)

STOLEN = TOKENS["alpha"]
KEPT = "alpha-kept-token-0123456789"


def _config(*tenants: str, server: str = "") -> str:
    return "\n".join(
        [
            "[server]",
            "threads = 2",
            "shutdown_grace_s = 2",
            "compile_timeout_s = 120",
            *([server] if server else []),
            *tenants,
        ]
    )


def _alpha(*tokens: str) -> str:
    hashes = ", ".join(f'"{hash_token(token)}"' for token in tokens)
    return "\n".join(
        [
            "[[tenants]]",
            'name = "alpha"',
            f"token_sha256s = [{hashes}]",
            'evaluators = ["calc"]',
            "allow_register = true",
            "",
        ]
    )


def _reload(daemon: Daemon, config: str, count: int) -> None:
    """Writes ``config``, sends SIGHUP and waits for the daemon's word that it reloaded."""
    daemon.config_path.write_text(config)
    daemon.process.send_signal(signal.SIGHUP)
    until(
        lambda: sum(line.get("msg") == "config reloaded" for line in daemon.log_lines()) >= count,
        f"{count} reloads",
    )


@contextmanager
def _stalled_worker(daemon: Daemon, client: Client) -> Iterator[int]:
    """The daemon's compile worker, stopped (SIGSTOP) until the block ends."""
    client.register(module("echo", "warm_up"))  # the worker exists from now on
    workers = [pid for pid, cmd in process_descendants(daemon.pid).items() if "spawn_main" in cmd]
    assert len(workers) == 1, process_descendants(daemon.pid)
    os.kill(workers[0], signal.SIGSTOP)
    try:
        yield workers[0]
    finally:
        if process_alive(workers[0]):
            os.kill(workers[0], signal.SIGCONT)


class _Registration(threading.Thread):
    """One registration in a thread of its own, and its outcome."""

    def __init__(self, client: Client, wasm: bytes, *, replace: bool = False) -> None:
        super().__init__(daemon=True)
        self.client, self.wasm, self.replace = client, wasm, replace
        self.outcome = ""
        self.message = ""

    def run(self) -> None:
        try:
            self.client.register(self.wasm, replace=self.replace)
            self.outcome = "registered"
        except CallError as error:
            self.outcome = error.code.value if error.code is not None else "unreachable"
            self.message = str(error)


def _compiling(daemon: Daemon, turns: int) -> None:
    """Waits until the daemon has started the compile queue's ``turns``-th registration."""
    until(
        lambda: any(
            line.get("msg") == "registration compiling" and line.get("turn") == turns
            for line in daemon.log_lines()
        ),
        f"registration {turns} compiling",
    )


def test_a_revocation_applies_while_another_tenants_module_compiles(tmp_path: Path) -> None:
    config = _config(_alpha(STOLEN), tenant_block("beta", evaluators=["calc"]))
    daemon = start_daemon(tmp_path, config)
    try:
        alpha = daemon.client("alpha", timeout_s=120.0)
        beta = daemon.client("beta")
        assert outcome(beta.evaluate("calc", "1+1")) == "ok"
        with _stalled_worker(daemon, alpha):
            slow = _Registration(alpha, module("echo", "slow"))
            slow.start()
            _compiling(daemon, 2)
            # beta removed: applied while alpha's module is still compiling
            _reload(daemon, _config(_alpha(STOLEN)), 1)
            with pytest.raises(CallError) as refused:
                beta.evaluate("calc", "1+1")
            assert refused.value.code is not None
            assert refused.value.code.value == "permission_denied"
            assert slow.is_alive() and slow.outcome == ""  # still compiling
        slow.join(timeout=120)
        assert slow.outcome == "registered", slow.message
        assert alpha.evaluate("slow", b"done").value == "done"
    finally:
        assert daemon.stop() == 0


def test_a_registration_whose_token_is_revoked_while_it_compiles_changes_nothing(
    tmp_path: Path,
) -> None:
    daemon = start_daemon(tmp_path, _config(_alpha(STOLEN, KEPT)))
    try:
        owner = Client(daemon.target, KEPT, timeout_s=60.0)
        daemon.clients.append(owner)
        owner.register(module("echo", "target"))
        thief = daemon.client("alpha", timeout_s=120.0)
        with _stalled_worker(daemon, owner):
            stolen = _Registration(
                thief, module("payload", "target", (b"taken", False)), replace=True
            )
            stolen.start()
            _compiling(daemon, 3)
            _reload(daemon, _config(_alpha(KEPT)), 1)  # the operator revokes the stolen token
            with pytest.raises(CallError):
                thief.evaluate("calc", "1+1")
        stolen.join(timeout=120)
        assert stolen.outcome == "permission_denied", (stolen.outcome, stolen.message)
        assert "no longer names tenant 'alpha'" in stolen.message
        assert owner.evaluate("target", b"still mine").value == "still mine"
        # the refusal is logged
        assert any(
            line.get("msg") == "call refused"
            and line.get("method") == "RegisterEvaluator"
            and line.get("code") == "permission_denied"
            for line in daemon.log_lines()
        )
    finally:
        assert daemon.stop() == 0


def _slow_to_compile(name: str) -> bytes:
    """A valid module that takes seconds to compile: 80 functions at the compile-cost limits
    (1,000 locals, 999 branches; 0.93 MB of code, under the 1 MiB cap)."""
    extra = " ".join(branchy_function(1000, 999) for _ in range(80))
    manifest = manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1")
    return guest("echo", manifest=manifest, extra=extra)


def test_a_daemon_serves_before_its_stored_modules_are_loaded(tmp_path: Path) -> None:
    # The state folder as a stopped daemon left it: the module and alpha's index (written by
    # the daemon's own store code), nothing compiled in its cache.
    state = tmp_path / "state"
    store = ModuleStore(state)
    wasm = _slow_to_compile("heavy")
    sha256, _ = store.put_module(wasm)
    store.write_index("alpha", {"heavy": store.new_entry("heavy", sha256)})
    daemon = start_daemon(tmp_path, _config(_alpha(STOLEN)), state_dir=state, wait=False)
    try:
        wait_serving(daemon)
        alpha = daemon.client("alpha")
        first = alpha.evaluate("heavy", b"x")
        assert outcome(first) == "unavailable", first
        assert "still loading" in first.error.message and "retry" in first.error.message
        assert outcome(alpha.evaluate("calc", "2+3")) == "ok"  # served meanwhile
        until(lambda: outcome(alpha.evaluate("heavy", b"x")) == "ok", "heavy served")
        messages = [line.get("msg") for line in daemon.log_lines()]
        assert messages.index("serving") < messages.index("registered modules loaded")
    finally:
        assert daemon.stop() == 0


@pytest.mark.parametrize(
    ("field", "inserted", "said"),
    [
        ("description", "\u0000", "NUL"),
        ("name", "\u0000", "NUL"),
        ("input_grammar", "\u0000", "NUL"),
        ("semantics_version", "\u0000", "NUL"),
        ("description", "\ud800", "lone surrogate"),
    ],
)
def test_a_manifest_text_no_store_can_keep_is_refused_as_an_invalid_module(
    tmp_path: Path, field: str, inserted: str, said: str
) -> None:
    daemon = start_daemon(tmp_path, _config(_alpha(STOLEN)))
    try:
        alpha = daemon.client("alpha")
        manifest = json.loads(manifest_bytes(name="nul", tag="nul", semantics_version="nul/1"))
        manifest[field] += inserted + "after"
        wasm = guest("echo", manifest=json.dumps(manifest).encode())
        with pytest.raises(CallError) as refused:
            alpha.register(wasm)
        assert refused.value.code is not None
        assert refused.value.code.value == "invalid_module", str(refused.value)
        assert said in str(refused.value) and field in str(refused.value)
        assert outcome(alpha.evaluate("calc", "1+1")) == "ok"
    finally:
        assert daemon.stop() == 0


def test_deleted_evaluators_and_removed_tenants_leave_no_metric_series(tmp_path: Path) -> None:
    port = free_port()
    config = _config(
        _alpha(STOLEN),
        tenant_block("beta", evaluators=["calc"], allow_register=True),
        server=f'metrics_listen = "127.0.0.1:{port}"',
    )
    daemon = start_daemon(tmp_path, config)
    try:
        alpha, beta = daemon.client("alpha"), daemon.client("beta")
        names = [f"churn{number}" for number in range(8)]
        for name in names:
            alpha.register(module("echo", name))
            assert alpha.evaluate(name, b"x").value == "x"
            assert outcome(alpha.evaluate(name, b"x" * 2_000_000)) == "input_too_large"
            alpha.delete(name)
        beta.register(module("echo", "kept"))
        assert beta.evaluate("kept", b"y").value == "y"
        text = _scrape(port)
        assert 'evaluator="kept"' in text  # the control: a served evaluator's series stay
        assert not [line for line in text.splitlines() if 'evaluator="churn' in line]
        # beta removed by a reload: none of its series stay either
        _reload(daemon, _config(_alpha(STOLEN), server=f'metrics_listen = "127.0.0.1:{port}"'), 1)
        assert not [line for line in _scrape(port).splitlines() if 'tenant="beta"' in line]
    finally:
        assert daemon.stop() == 0


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())
